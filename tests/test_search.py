"""The AC search (membudget/search.py, experiment=budget_search): what train.py reports to the study, the AC
sampler on a real Optuna study, a resumed study, real searches through train.py with the basic launcher and on
the local SLURM cluster, and the proof that it matches the grid with fewer jobs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import yaml

from membudget import search
from membudget.search import BudgetSampler, BudgetSearch, trial_record, values_of
from membudget.units import GiB, MiB
from tests.conftest import FAST_COMPILE, TINY, compose_cfg, multirun_here, read_summary, run_train

optuna = pytest.importorskip("optuna", reason="the search extra: pip install -e '.[search]'")
optuna.logging.set_verbosity(optuna.logging.WARNING)
TrialState = optuna.trial.TrialState
# the quickest real search: eager modes only (no compilation), two ranks of nothing but 3 short steps
EAGER = (*TINY, "checkpoint.enabled=false", "train.progress=off", "model.n_layers=2", "compile.enabled=null")


# --- what a trial reports -------------------------------------------------------------------------------------

def test_a_trial_reports_step_time_and_memory_and_whether_it_fits():
    summary = {"median_step_time_s": 0.02, "activation_bytes": 3 * MiB, "peak_memory_bytes": 9 * GiB,
               "final_loss": 5.0}
    cfg = compose_cfg("ac=memory_budget", "ac.memory_budget=0.25", "ac.target_memory_gib=0.0025")
    cpu = trial_record(cfg, summary, "cpu")
    # on CPU the memory is the run's activations (the process's RSS is not the run's), on a GPU its CUDA peak
    assert cpu["memory_key"] == "activation_bytes" and cpu["memory_bytes"] == 3 * MiB
    assert cpu["setting"] == "memory_budget 0.25" and cpu["target_bytes"] == int(0.0025 * GiB) and not cpu["fits"]
    assert values_of(cpu, 2) == [0.02, 3 * MiB]
    assert values_of(cpu, 1) == math.inf  # does not fit: never the answer of the constrained search
    gpu = trial_record(compose_cfg("ac.target_memory_gib=10"), summary, "cuda")
    assert gpu["memory_key"] == "peak_memory_bytes" and gpu["fits"] and values_of(gpu, 1) == 0.02
    # outside an Optuna search train.py returns the final loss, as before
    assert search.objective(cfg, summary) == 5.0


# --- the AC sampler, on a real Optuna study --------------------------------------------------------------------

SPACE = {"ac": ["none", "full", "selective", "memory_budget"], "ac.selective_option": ["op", "2"]}


def _memory(budget: float) -> float:
    """Activation bytes of a budget as the partitioner gives them: rising, with a plateau (0.6-0.9)."""
    return 1e5 + 8e5 * min(budget, 0.6) + (2e5 if budget > 0.9 else 0.0)


def _ask(study, n_objectives: int, target: float = math.inf) -> tuple[object, str, float | None]:
    trial = study.ask()
    mode = trial.suggest_categorical("ac", SPACE["ac"])
    budget = option = None
    if mode == "selective":
        option = trial.suggest_categorical("ac.selective_option", SPACE["ac.selective_option"])
    if mode == "memory_budget":
        budget = trial.suggest_float("ac.memory_budget", 0.0, 1.0)
    return trial, f"{mode} {option or ''}".strip(), budget


def _run(study, trial, budget, n_objectives, target=math.inf) -> None:
    memory = _memory(budget) if budget is not None else 5e5
    time = 1.0 - (budget or 0.0) / 2
    study.tell(trial, [time, memory] if n_objectives == 2 else (time if memory <= target else math.inf))


def test_the_constrained_sampler_bisects_to_the_largest_budget_that_fits():
    target = _memory(0.37)
    study = optuna.create_study(direction="minimize", sampler=BudgetSampler(resolution=1 / 64))
    proposed = []
    while True:
        trial, setting, budget = _ask(study, 1)
        if (setting, budget) in proposed:
            break  # a setting already tried: the sampler has nothing left (the sweeper ends the search there)
        proposed.append((setting, budget))
        _run(study, trial, budget, 1, target)
    settings = [s for s, _ in proposed]
    # each discrete setting once, in order, then the ends of the interval (the largest first) and bisection
    assert settings[:4] == ["none", "full", "selective op", "selective 2"]
    budgets = [b for _, b in proposed[4:]]
    assert budgets[:3] == [1.0, 0.0, 0.5] and len(budgets) <= 2 + 6 + 1
    fitting = max(b for b in budgets if _memory(b) <= target)
    assert 0.37 - 1 / 64 <= fitting <= 0.37


def test_the_pareto_sampler_splits_where_memory_changes_and_skips_plateaus():
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=BudgetSampler(resolution=1 / 32))
    budgets = []
    for _ in range(4 + 10):
        trial, setting, budget = _ask(study, 2)
        if budget is not None:
            budgets.append(budget)
        _run(study, trial, budget, 2)
    assert budgets[:3] == [0.0, 1.0, 0.5]
    assert len(set(budgets)) == len(budgets)
    # between two tried budgets of equal memory (the plateau) nothing more is tried: nothing is there to find
    for i, a in enumerate(budgets):
        for b in budgets[:i]:
            later = budgets[max(i, budgets.index(b)) + 1:]
            if _memory(a) == _memory(b):
                assert not [c for c in later if min(a, b) < c < max(a, b)], (a, b, budgets)
    assert any(0.9 < b < 1.0 for b in budgets)  # the jump above 0.9 is refined


def test_a_batch_of_parallel_trials_gets_distinct_budgets():
    study = optuna.create_study(direction="minimize", sampler=BudgetSampler())
    for _ in range(4 + 2):  # the discrete settings and both ends
        trial, _, budget = _ask(study, 1)
        _run(study, trial, budget, 1, target=_memory(0.3))
    batch = [_ask(study, 1)[2] for _ in range(3)]  # asked together, none told yet
    assert len(set(batch)) == 3 and all(0.0 < b < 1.0 for b in batch)


# --- a resumed study -------------------------------------------------------------------------------------------

def _search_for(sweep_dir: Path, n_objectives: int = 2) -> BudgetSearch:
    hydra_cfg = compose_cfg("experiment=budget_search", f"hydra.sweep.dir={sweep_dir}", hydra=True)
    s = BudgetSearch(BudgetSampler(), ["minimize"] * n_objectives, f"sqlite:///{sweep_dir}/study.db", "s",
                     n_trials=4, n_jobs=1, max_failure_rate=0.5)
    s.config, s.sweep_dir = hydra_cfg, sweep_dir
    return s


def test_a_resumed_search_tells_what_finished_unwatched_and_reruns_what_did_not(tmp_path):
    # an earlier sweeper asked two trials, launched them as jobs 0 and 1, and stopped before either returned;
    # job 0 finished meanwhile (its trial.json is there), job 1 never did
    s = _search_for(tmp_path)
    study = s._open_study(["model.n_layers=2"])
    finished, lost = study.ask({"ac": optuna.distributions.CategoricalDistribution(["none", "full"])}), None
    lost = study.ask({"ac": optuna.distributions.CategoricalDistribution(["none", "full"])})
    for job, trial in enumerate((finished, lost)):
        trial.set_user_attr("job", job)
    (tmp_path / "0").mkdir()
    record = {"setting": "none", "median_step_time_s": 0.01, "memory_key": "activation_bytes",
              "memory_bytes": 1234, "target_bytes": None, "fits": None}
    (tmp_path / "0" / search.TRIAL_FILE).write_text(json.dumps(record))

    s = _search_for(tmp_path)  # a new sweeper process: the same command
    study = s._open_study(["model.n_layers=2"])
    s._recover(study)
    done, stale = study.trials[finished.number], study.trials[lost.number]
    assert done.state == TrialState.COMPLETE and done.values == [0.01, 1234] and done.user_attrs["recovered"]
    assert stale.state == TrialState.FAIL and stale.user_attrs["stale"]
    rerun = study.ask({"ac": optuna.distributions.CategoricalDistribution(["none", "full"])})
    assert rerun.params == stale.params  # its setting runs again, as a new trial (and job)
    # the constrained form needs a target before any job starts
    with pytest.raises(search.UserError, match="ac.target_memory_gib=None: the fastest setting that fits"):
        _search_for(tmp_path / "fit", n_objectives=1)._open_study([])
    # another command may not continue this study: it would mix two searches
    with pytest.raises(search.UserError, match="hydra.sweep.dir=.*belongs to another search"):
        _search_for(tmp_path)._open_study(["model.n_layers=4"])


# --- real searches through train.py ----------------------------------------------------------------------------

def _study(sweep_dir: Path) -> list[dict]:
    return sorted(search.trials(sweep_dir), key=lambda t: t["number"])


@pytest.mark.slow
def test_failed_jobs_are_failed_trials_and_a_rerun_continues_with_the_next_job(tmp_path, capsys):
    sweep = tmp_path / "search"
    # compile.enabled=false: every memory_budget trial fails its config check, a real failed job
    args = ("experiment=budget_search", *EAGER, "compile.enabled=false", "ac=choice(none,full,memory_budget)")
    first = run_train(sweep, *args, "hydra.sweeper.n_trials=6", "hydra.sweeper.max_failure_rate=0.3", multirun=True)
    assert first.returncode != 0
    assert "max_failure_rate=0.3: 1 of 3 jobs failed (the last, job 2: UserError" in first.stderr + first.stdout
    trials = _study(sweep)
    assert [(t["params"], t["state"]) for t in trials] == [
        ({"ac": "none"}, "COMPLETE"), ({"ac": "full"}, "COMPLETE"),  # no budget sampled: it would not matter
        ({"ac": "memory_budget", "ac.memory_budget": 0.0}, "FAIL")]
    assert "compile.enabled=False" in trials[2]["error"] and [t["job"] for t in trials] == [0, 1, 2]
    none = trials[0]
    summary = read_summary(sweep / "0")
    assert none["values"] == [summary["median_step_time_s"], summary["activation_bytes"]]
    assert none["memory_key"] == "activation_bytes"
    # the front: full keeps the least memory, so it is on it; none is on it exactly when it is faster than full
    # (CPU step times decide that, and they are noise here: assert the rule, not an outcome)
    full = trials[1]
    assert full["best"] and none["best"] == (none["values"][0] < full["values"][0]), (none, full)
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())  # Hydra's Optuna sweeper's summary
    assert {s["job"] for s in results["solutions"]} == {t["job"] for t in trials if t["best"]}

    # the same command again, with more trials allowed: only what is left runs, numbered on from job 3 (in this
    # process: the failed search's one line above was the subprocess's point; a failure here raises)
    capsys.readouterr()
    multirun_here(sweep, *args, "hydra.sweeper.n_trials=5", "hydra.sweeper.max_failure_rate=1.0")
    second = capsys.readouterr()
    assert "3 of 5 trials done, 2 to go" in second.out + second.err
    trials = _study(sweep)
    ran = [t for t in trials if "job" in t]
    assert [t["job"] for t in ran] == [0, 1, 2, 3] and ran[3]["params"]["ac.memory_budget"] == 1.0
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    # then both ends of the budget failed: nothing between them can be learnt, so the search ended
    assert [(t["state"], t["duplicate_of"]) for t in trials if "job" not in t] == [("PRUNED", 2)]


@pytest.mark.slow
@pytest.mark.slurm
def test_a_search_on_the_local_slurm_cluster(tmp_path):
    from tests.test_slurm_cluster import _DOWN

    if _DOWN is not None:
        if os.environ.get("MEMBUDGET_REQUIRE_SLURM"):
            pytest.fail(_DOWN)
        pytest.skip(_DOWN)
    sweep = tmp_path / "search"
    # two trials at once, one SLURM job each (one task of one CPU each: the local node has two)
    done = run_train(sweep, "experiment=budget_search", *EAGER, "ac=choice(none,full,selective)",
                     "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=1", "hydra.sweeper.n_trials=2",
                     "hydra.sweeper.n_jobs=2", multirun=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    trials = _study(sweep)
    assert [(t["params"], t["state"], t["job"]) for t in trials] == [
        ({"ac": "none"}, "COMPLETE", 0), ({"ac": "full"}, "COMPLETE", 1)]
    for t in trials:  # each value is what its SLURM job measured and wrote into its run dir
        summary = read_summary(sweep / str(t["job"]))
        assert t["values"] == [summary["median_step_time_s"], summary["activation_bytes"]]
    assert list((sweep / ".submitit").glob("*/*_0_log.out")), "no SLURM job logs"
    assert {t["number"] for t in trials if t["best"]} >= {1}  # full keeps the least: on the front


# --- the proof: as good as the grid, with fewer jobs -------------------------------------------------------------

PROOF = (*TINY, FAST_COMPILE, "checkpoint.enabled=false", "train.progress=off", "model.n_layers=2",
         "compile.enabled=null")  # the reference modes eager, in the grid and the search alike


def _predicted_step(plans: dict, mode: str, activation_bytes: int, option: str = "op") -> float:
    """The step's FLOPs as the planner prices them, in units of its forward: forward + backward (twice the
    forward) + recompute. A budget's recompute is read off the planned budget line at the activation bytes the
    run measured (the partitioner trades the one for the other, budget by budget)."""
    import numpy as np

    forward = plans["none"].forward_flops
    if mode != "memory_budget":
        recompute = plans[mode if mode != "selective" else f"selective {option}"].recompute_flops
    else:
        line = sorted((p.activations, p.recompute_flops) for k, p in plans.items() if k.startswith("memory_budget"))
        recompute = float(np.interp(activation_bytes, *zip(*line)))
    return (3 * forward + recompute) / forward


@pytest.mark.slow
def test_the_search_finds_the_grids_best_tradeoff_with_fewer_jobs_and_the_planner_agrees(tmp_path):
    """Step times of 3 tiny CPU steps are noise (the machine is shared), so the comparison is made on what is
    deterministic: each run's measured activation bytes, and the planner's FLOPs for its setting (recompute
    read off the planned budget line at the measured bytes). The search's own decisions never look at step
    times either (the AC sampler bisects on memory)."""
    from membudget.plan import Planner, choose
    from membudget.plan.result import DOES_NOT_FIT, FITS, fits_within
    from membudget.trainer import train

    # the target: full AC's activations plus 35% of what no AC adds, between the grid's budgets 0.4 and 0.5
    kept = {m: train(compose_cfg(*PROOF, f"ac={m}"), tmp_path / m)["activation_bytes"] for m in ("none", "full")}
    target = kept["full"] + 0.35 * (kept["none"] - kept["full"])
    grid_dir, search_dir = tmp_path / "grid", tmp_path / "search"
    # both through train.py in this process (the basic launcher runs the jobs in it anyway); a failure raises
    multirun_here(grid_dir, "experiment=budget_sweep", *PROOF)
    multirun_here(search_dir, "experiment=budget_search", "hydra/sweeper=budget_fit", *PROOF,
                  f"ac.target_memory_gib={target / GiB!r}", "hydra.sweeper.n_trials=12")
    # the planner: every grid budget (what ac.memory_budget=auto chooses from), and the reference modes
    cfg = compose_cfg(*PROOF, "ac=memory_budget", "train.device=cpu")
    with Planner(cfg) as planner:
        plans = {f"memory_budget {b}": planner.plan(planner.point("memory_budget", b), str(b))
                 for b in cfg.plan.budgets}
        for mode, option in (("none", None), ("full", None), ("selective", "op"), ("selective", "2")):
            point = planner.point(mode)
            if option:
                point.ac.selective_option = option
            plans[f"{mode} {option}" if option else mode] = planner.plan(point, mode)

    grid_points = []
    for job in sorted(p for p in grid_dir.iterdir() if p.name.isdigit()):
        s = read_summary(job)
        grid_points.append((s["ac_label"], _predicted_step(plans, s["ac_mode"], s["activation_bytes"],
                                                           s["selective_option"] or "op"), s["activation_bytes"]))
    trials = [t for t in _study(search_dir) if "job" in t]
    search_points = [(t["setting"], _predicted_step(plans, t["params"]["ac"], t["memory_bytes"],
                                                    t["params"].get("ac.selective_option", "op")), t["memory_bytes"])
                     for t in trials if t["state"] == "COMPLETE"]
    assert len(grid_points) == 14 and len(trials) <= 12

    def best(points):  # the fastest (predicted) that fits the target
        return min((p for p in points if p[2] <= target), key=lambda p: p[1])

    grid_best, search_best = best(grid_points), best(search_points)
    assert search_best[1] <= 1.05 * grid_best[1]
    # the figures the README quotes (deterministic: measured activation bytes, planned FLOPs, a bisecting sampler)
    assert len(trials) == 11, [t["setting"] for t in trials]
    assert search_best[0] == "memory_budget 0.4375" and search_best[2] == 690_948, search_best
    assert grid_best[0] == "memory_budget 0.4" and grid_best[2] == 625_412, grid_best
    assert 1 - search_best[1] / grid_best[1] == pytest.approx(0.023, abs=0.001), (search_best, grid_best)  # cheaper

    # the planner's own choice for the same target: its `fits` rule and its `choose` (what ac.memory_budget=auto
    # runs), held against the planned activations, which is what the target means on a CPU (the search's memory);
    # every budget's allocated peak is the optimizer step's here, the same for all
    budget_plans = [dataclasses.replace(p, limit=int(target), verdict=FITS if fits_within(p.activations, int(target))
                                        else DOES_NOT_FIT)
                    for k, p in plans.items() if k.startswith("memory_budget")]
    auto = choose(budget_plans)
    assert auto is not None and auto.memory_budget == 0.4  # as the README says
    auto_step = _predicted_step(plans, "memory_budget", auto.activations)
    measured = next(p for p in grid_points if p[0] == f"memory_budget {auto.memory_budget!r}")
    assert measured[2] <= target  # the run of auto's budget fits as planned
    # on the search's front: no trial keeps as little and is more than 5% faster, and the search's answer for
    # the target, its neighbour on the front, is within 5% of it
    assert not [p for p in search_points if p[2] <= auto.activations and p[1] < 0.95 * auto_step]
    assert abs(search_best[1] - auto_step) <= 0.05 * auto_step
