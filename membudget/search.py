"""The AC search: Hydra's Optuna sweeper over AC settings, for the trade-off of step time against memory measured
on the user's own hardware, with fewer jobs than the grid (experiment=budget_sweep).

    python train.py -m experiment=budget_search                        # the Pareto front of step time vs memory
    python train.py -m experiment=budget_search hydra/sweeper=budget_fit ac.target_memory_gib=70   # fastest that fits
    python train.py -m experiment=budget_search hydra/launcher=slurm   # one SLURM job per trial

Rerunning the same command continues the same search in the same dir: only the trials still to go run, numbered
on from the last job. A different command (another model, another target) is another search, in its own dir.

The pieces:
- `objective(cfg, summary)`: what train.py returns. Two objectives, [median step time (s), memory (bytes)], both
  minimised, so the study's best trials are its Pareto front; one objective (`hydra/sweeper=budget_fit`), the
  median step time of a run whose memory fits `ac.target_memory_gib`, inf for one that does not (never the
  answer). Memory is the CUDA peak allocated on a GPU; on a CPU, the run's activation bytes (the process's peak
  RSS is the whole process's, not the run's). A failed job (an OOM, a config error) raises, and is a failed trial.
- `BudgetSearch`: the sweeper. Hydra's Optuna sweeper, plus: the study is in SQLite under the sweep dir and a
  resumed search runs only the remaining trials; parameters that only matter for one AC mode are only sampled
  for it (`ac.memory_budget` for memory_budget, `ac.selective_option` for selective); a setting already tried is
  not run again; failed jobs are failed trials, and the search goes on until more than
  hydra.sweeper.max_failure_rate of its jobs failed (judged once 3 ended).
- `BudgetSampler` (`hydra/sweeper/sampler=budget`, the default): each discrete setting once (none, full, each
  selective option), then the budget interval by bisection on memory, which is deterministic where step times
  are noisy: the two-objective search splits the budget gap across which memory changes most; the constrained
  one closes in on the largest budget that fits. Any Optuna sampler works instead (hydra/sweeper/sampler=tpe).

The sweep dir, as the report reads it:
    study.db                    the Optuna study (read it with `trials(sweep_dir)`): one trial per proposal
    optimization_results.yaml   Hydra's Optuna sweeper's summary: the Pareto solutions, or the best trial
    <job>/                      each job's run dir (summary.json, metrics.jsonl, .hydra/), and trial.json: what
                                the objective returned and from what (memory kind and bytes, step time, fits)
Trial user attributes: job (its subdir), overrides, setting (ac_label), memory_key, memory_bytes,
median_step_time_s, target_bytes, fits, error (a failed job: its first line), duplicate_of (a proposal not run:
the trial that already ran it), stale and recovered (a trial whose job outlived an earlier sweeper process).
Study user attributes: arguments and params (the command that owns the study), objectives (the values' names).
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from membudget.errors import UserError, one_line
from membudget.schema import ac_label
from membudget.units import GiB

log = logging.getLogger("membudget")
STEP_TIME = "median_step_time_s"
TRIAL_FILE = "trial.json"
# Parameters that only matter for one AC mode: a trial of another mode does not sample them, so two proposals
# that differ only in them are one setting.
ONLY_FOR_MODE = {
    "ac.memory_budget": "memory_budget",
    "ac.solver": "memory_budget",
    "ac.runtime_estimator": "memory_budget",
    "ac.selective_option": "selective",
    "ac.force_recompute_modules": "selective",
}
MIN_JOBS_BEFORE_GIVING_UP = 3  # the failure rate is judged once this many jobs ended
DUPLICATES_IN_A_ROW = 20  # a random sampler proposing only settings already tried: the space is exhausted


# --- the objective: what train.py returns ----------------------------------------------------------------------

def memory_key(device_type: str) -> str:
    """The summary's memory figure the search minimises on this device."""
    return "peak_memory_bytes" if device_type == "cuda" else "activation_bytes"


def trial_record(cfg, summary: dict, device_type: str) -> dict:
    """What a trial is judged on, from its run's summary."""
    key = memory_key(device_type)
    target = cfg.ac.target_memory_gib
    target_bytes = None if target is None else int(target * GiB)
    memory = summary.get(key)
    return {
        "setting": ac_label(cfg.ac),
        STEP_TIME: summary.get(STEP_TIME),
        "memory_key": key,
        "memory_bytes": memory,
        "target_bytes": target_bytes,
        "fits": None if target_bytes is None or memory is None else memory <= target_bytes,
    }


def values_of(record: dict, n_objectives: int) -> Union[list[float], float]:
    """The trial's values: [step time, memory], or the step time when it fits (else inf)."""
    if n_objectives == 2:
        return [float(record[STEP_TIME]), float(record["memory_bytes"])]
    return float(record[STEP_TIME]) if record["fits"] else math.inf


def search_directions() -> Optional[list[str]]:
    """The directions of the Optuna study this job is a trial of; None outside an Optuna sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    sweeper = HydraConfig.get().sweeper
    return directions_of(sweeper.direction) if "direction" in sweeper else None


def directions_of(direction: Any) -> list[str]:
    if isinstance(direction, (ListConfig, list, tuple)):
        return [d.name if isinstance(d, Enum) else str(d) for d in direction]
    return [direction.name if isinstance(direction, Enum) else str(direction)]


def objective(cfg, summary: dict):
    """What train.py returns: in an Optuna search, the trial's values (see the module docstring), and its
    record written to <run dir>/trial.json; otherwise the final loss. A run without the figures raises: the
    trial fails rather than being told a made-up value."""
    directions = search_directions()
    if directions is None:
        return summary["final_loss"]
    from hydra.core.hydra_config import HydraConfig

    from membudget.launch import launch_from_env, pick_device

    launch = launch_from_env()
    record = trial_record(cfg, summary, pick_device(str(cfg.train.device), launch).type)
    if len(directions) == 1 and record["target_bytes"] is None:
        raise UserError("ac.target_memory_gib=None: the fastest setting that fits (hydra/sweeper=budget_fit) needs a "
                        "target; set ac.target_memory_gib=N (GiB)")
    missing = [k for k in (STEP_TIME, "memory_bytes") if record[k] is None]
    if missing:
        raise UserError(f"train.steps={cfg.train.steps}: the run has no {' or '.join(missing)} to report to the "
                        "search; run at least 2 steps")
    if launch.is_main:
        out = Path(HydraConfig.get().runtime.output_dir) / TRIAL_FILE
        out.write_text(json.dumps(record, indent=1) + "\n")
    return values_of(record, len(directions))


# --- the sampler -----------------------------------------------------------------------------------------------

def _optuna():
    import optuna

    return optuna


class BudgetSampler:
    """An Optuna sampler for the AC setting (BaseSampler's interface, not its subclass: this module imports
    without optuna, as train.py imports it in every job). Optuna asks it one parameter at a time:
    - `ac` (the mode): each discrete option once, in the order listed (selective once per selective option),
      then memory_budget;
    - `ac.selective_option`: each option once;
    - `ac.memory_budget` (an interval): first its two ends, then one point between two tried budgets: with two
      objectives, the midpoint of the gap across which memory changes most; with one (the constrained form),
      the midpoint between the largest budget that fits and the smallest that does not. Budgets closer than
      `resolution` of the interval are not told apart; when no gap is left it proposes a budget already tried,
      which the sweeper takes as the end of the search. Running trials count as tried (memory interpolated),
      so a batch of parallel jobs gets distinct points; failed trials count as not fitting.
    Any other parameter is sampled by TPE. Step times steer nothing here: they are noisy, memory is not.
    """

    repeats_only_when_done = True  # the sweeper ends the search at its first proposal of a tried setting

    def __init__(self, resolution: float = 1 / 32, seed: Optional[int] = None):
        self.resolution = resolution
        self._others = _optuna().samplers.TPESampler(seed=seed)

    def infer_relative_search_space(self, study, trial) -> dict:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study, trial, param_name: str, param_distribution):
        optuna = _optuna()
        d = optuna.distributions
        tried = [t for t in study.get_trials(deepcopy=False)
                 if t.number != trial.number and t.state != optuna.trial.TrialState.PRUNED
                 and not t.user_attrs.get("stale")]
        if param_name == "ac" and isinstance(param_distribution, d.CategoricalDistribution):
            return self._mode(tried, param_distribution.choices)
        if param_name == "ac.selective_option" and isinstance(param_distribution, d.CategoricalDistribution):
            used = {t.params.get(param_name) for t in tried}
            return next((c for c in param_distribution.choices if c not in used), param_distribution.choices[0])
        if param_name == "ac.memory_budget" and isinstance(param_distribution, (d.UniformDistribution,
                                                                               d.DiscreteUniformDistribution)):
            budget = self._budget(study, tried, param_distribution.low, param_distribution.high)
            q = getattr(param_distribution, "q", None)
            return budget if q is None else param_distribution.low + round((budget - param_distribution.low) / q) * q
        return self._others.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        self._others.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._others.reseed_rng()

    @staticmethod
    def _mode(tried, choices) -> Any:
        for choice in choices:
            if choice == "memory_budget":
                continue
            runs = [t for t in tried if t.params.get("ac") == choice]
            wanted = 1
            if choice == "selective":  # one run per selective option, when the option is searched too
                options = next((t.distributions["ac.selective_option"] for t in runs
                                if "ac.selective_option" in t.distributions), None)
                wanted = len(options.choices) if options is not None else 1
            if len(runs) < wanted:
                return choice
        return "memory_budget" if "memory_budget" in choices else choices[0]

    def _budget(self, study, tried, low: float, high: float) -> float:
        state = _optuna().trial.TrialState
        constrained = len(study.directions) == 1
        # budget -> memory (two objectives) or whether it fits (one); None while its trial runs
        points: dict[float, Any] = {}
        for t in tried:
            if "ac.memory_budget" not in t.params or t.params.get("ac", "memory_budget") != "memory_budget":
                continue
            b = float(t.params["ac.memory_budget"])
            if t.state == state.COMPLETE:  # values: [step time, memory], or the step time (inf: does not fit)
                points[b] = math.isfinite(t.values[0]) if constrained else t.values[1]
            elif t.state == state.FAIL:
                points[b] = False if constrained else math.inf
            else:
                points[b] = None
        for end in ((high, low) if constrained else (low, high)):
            if end not in points:
                return end
        min_gap = self.resolution * (high - low)
        return self._bisect_fit(points, high, min_gap) if constrained else self._split_front(points, min_gap)

    @staticmethod
    def _bisect_fit(fits: dict, high: float, min_gap: float) -> float:
        """The midpoint of the widest interval, between running trials, of the bracket (largest budget that
        fits, smallest above it that does not)."""
        fitting = [b for b, ok in fits.items() if ok]
        if fits[high] or not fitting:
            return high  # the largest budget fits (nothing is faster), or not even the smallest does
        lo = max(fitting)
        hi = min((b for b, ok in fits.items() if ok is False and b > lo), default=high)
        inside = sorted({lo, hi, *(b for b, ok in fits.items() if ok is None and lo < b < hi)})
        width, left = max((right - left, left) for left, right in zip(inside, inside[1:]))
        return left + width / 2 if width >= 2 * min_gap else lo

    @staticmethod
    def _split_front(memory: dict, min_gap: float) -> float:
        """The midpoint of the gap between tried budgets across which memory changes most; a running trial's
        memory is interpolated from the measured ones, a failed one's is infinite."""
        import numpy as np

        budgets = sorted(memory)
        known = [(b, memory[b]) for b in budgets if memory[b] is not None and math.isfinite(memory[b])]

        def estimate(b: float) -> float:
            if memory[b] is not None:
                return memory[b]
            xs, ys = zip(*known)
            return float(np.interp(b, xs, ys))

        gaps = []
        for left, right in zip(budgets, budgets[1:]):
            if right - left < 2 * min_gap:
                continue
            if memory[left] == memory[right] == math.inf:
                change = 0.0  # between two failures: nothing to learn
            elif len(known) < 2:  # nothing to interpolate from yet: memory grows about linearly with the budget
                change = right - left
            else:
                change = abs(estimate(right) - estimate(left))
            gaps.append((change, right - left, -left))
        if not gaps or max(gaps)[0] <= 0:
            return budgets[0]  # tried: the front is as fine as the resolution allows
        _, width, neg_left = max(gaps)
        return -neg_left + width / 2


# --- the sweeper -----------------------------------------------------------------------------------------------

def _suggest(trial, name: str, distribution) -> Any:
    """Sample one parameter through Optuna's public suggest API."""
    d = _optuna().distributions
    if isinstance(distribution, d.CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    if isinstance(distribution, d.IntUniformDistribution):
        return trial.suggest_int(name, distribution.low, distribution.high, step=distribution.step)
    if isinstance(distribution, d.IntLogUniformDistribution):
        return trial.suggest_int(name, distribution.low, distribution.high, log=True)
    if isinstance(distribution, d.DiscreteUniformDistribution):
        return trial.suggest_float(name, distribution.low, distribution.high, step=distribution.q)
    if isinstance(distribution, d.LogUniformDistribution):
        return trial.suggest_float(name, distribution.low, distribution.high, log=True)
    return trial.suggest_float(name, distribution.low, distribution.high)


def _setting(params: dict) -> str:
    """One key per setting: only the parameters that apply were sampled, so equal keys are equal runs."""
    return json.dumps(sorted([k, str(v)] for k, v in params.items()))


class BudgetSearch:
    """Hydra's Optuna sweeper (its config, hydra/sweeper=optuna's keys), made for AC settings and resumable; see
    the module docstring. One batch of `n_jobs` trials at a time goes to the launcher (basic or SLURM)."""

    def __init__(self, sampler, direction, storage, study_name, n_trials: int, n_jobs: int,
                 max_failure_rate: float, search_space=None, custom_search_space=None, params=None):
        if search_space or custom_search_space:
            raise UserError("hydra.sweeper.search_space/custom_search_space: not read by hydra/sweeper=budget_search; "
                            "list what to search under hydra.sweeper.params (Hydra's sweep syntax)")
        if not hasattr(sampler, "sample_independent"):
            raise UserError(f"hydra/sweeper/sampler: {type(sampler).__name__} is not an Optuna sampler here (the grid "
                            "sampler needs the whole grid: use experiment=budget_sweep); use budget, tpe or random")
        self.sampler = sampler
        self.directions = directions_of(direction)
        self.storage = storage
        self.study_name = study_name
        self.n_trials = n_trials
        self.n_jobs = max(1, n_jobs)
        self.max_failure_rate = max_failure_rate
        self.params = dict(OmegaConf.to_container(params) if isinstance(params, DictConfig) else params or {})

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                               task_function=task_function)
        self.sweep_dir = Path(config.hydra.sweep.dir)

    # the study ------------------------------------------------------------------------------------------------

    def _open_study(self, arguments: list[str]):
        optuna = _optuna()
        if len(self.directions) not in (1, 2):
            raise UserError(f"hydra.sweeper.direction={self.directions}: the AC search has one objective (the step "
                            "time of what fits) or two (step time, memory)")
        if len(self.directions) == 1 and self.config.ac.target_memory_gib is None:
            raise UserError("ac.target_memory_gib=None: the fastest setting that fits (one objective) needs a "
                            "target; set ac.target_memory_gib=N (GiB), or search the Pareto front "
                            "(hydra/sweeper=budget_search)")
        self.sweep_dir.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its dir
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                    directions=self.directions, load_if_exists=True)
        owner = {"arguments": sorted(arguments), "params": {k: str(v) for k, v in sorted(self.params.items())}}
        if "arguments" not in study.user_attrs:
            for key, value in owner.items():
                study.set_user_attr(key, value)
            study.set_user_attr("objectives", [STEP_TIME, "memory_bytes"][:len(self.directions)])
        elif {k: study.user_attrs[k] for k in owner} != owner:
            raise UserError(f"hydra.sweep.dir={self.sweep_dir}: its study {study.study_name!r} belongs to another "
                            f"search ({' '.join(study.user_attrs['arguments']) or 'no overrides'}, params "
                            f"{study.user_attrs['params']}); rerun that command to continue it, or give this one its "
                            "own hydra.sweep.dir")
        return study

    def _job_dir(self, job: int) -> Path:
        return self.sweep_dir / str(job)  # conf/config.yaml: hydra.sweep.subdir is the job's number

    def _recover(self, study) -> None:
        """Trials left running by a sweeper that stopped (a requeue, a lost login session): a job that finished
        meanwhile is told from its trial.json; one that did not is failed as stale, and its setting queued
        again."""
        from membudget.internals import optuna_set_user_attr

        optuna = _optuna()
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            job = t.user_attrs.get("job")
            path = None if job is None else self._job_dir(job) / TRIAL_FILE
            if path is not None and path.exists():
                record = json.loads(path.read_text())
                for key, value in {**record, "recovered": True}.items():
                    optuna_set_user_attr(study, t, key, value)
                study.tell(t.number, values_of(record, len(self.directions)))
                log.info("trial %d (job %s) finished while no sweeper waited for it: told from %s", t.number, job, path)
                continue
            optuna_set_user_attr(study, t, "stale", True)
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            with warnings.catch_warnings():  # "experimental" since Optuna 1.2, and still there in 4
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.enqueue_trial(dict(t.params))
            log.warning("trial %d (job %s) was left unfinished by an earlier sweeper: its setting runs again",
                        t.number, job)

    # the loop -------------------------------------------------------------------------------------------------

    def _configure(self, trial, searched: dict, fixed: dict) -> list[str]:
        """Sample the trial's parameters, those of other AC modes left out; its overrides."""
        mode = str(fixed.get("ac", self.config.ac.mode))
        params: dict[str, Any] = {}
        for name in sorted(searched, key=lambda n: n != "ac"):  # the mode first: it decides what else applies
            needs = ONLY_FOR_MODE.get(name)
            if needs is not None and mode != needs:
                continue
            params[name] = _suggest(trial, name, searched[name])
            if name == "ac":
                mode = str(params[name])
        return [f"{k}={v}" for k, v in {**params, **fixed}.items()]

    def sweep(self, arguments: list[str]) -> None:
        from membudget.internals import optuna_search_space

        searched, fixed = optuna_search_space([f"{k}={v}" for k, v in self.params.items()] + list(arguments))
        for name in fixed:
            searched.pop(name, None)
        study = self._open_study(list(arguments))
        self._recover(study)
        try:
            self._search(study, searched, fixed)
        finally:  # also when the search stopped for its failures: what it found so far
            self._write_results(study)

    def _search(self, study, searched: dict, fixed: dict) -> None:
        """Batches of trials until n_trials jobs ended (this run's and the earlier runs'), the sampler has nothing
        new to propose, or most jobs failed."""
        TrialState = _optuna().trial.TrialState
        trials = study.get_trials(deepcopy=False)
        ran = [t for t in trials if "job" in t.user_attrs and not t.user_attrs.get("stale")]
        ended = [t for t in ran if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
        failures = [(t.user_attrs["job"], t.user_attrs.get("error")) for t in ended if t.state == TrialState.FAIL]
        first_run = {_setting(t.params): t.number for t in reversed(ran)}
        next_job = 1 + max((t.user_attrs["job"] for t in trials if "job" in t.user_attrs), default=-1)
        n_ended, to_go = len(ended), self.n_trials - len(ended)
        log.info("study %r in %s (%s): %d of %d trials done, %d to go; sampler %s", study.study_name, self.storage,
                 ", ".join(self.directions), n_ended, self.n_trials, max(0, to_go), type(self.sampler).__name__)
        # a sampler that repeats itself only when it has nothing new (the AC sampler) is done at its first repeat
        enough = 1 if getattr(self.sampler, "repeats_only_when_done", False) else DUPLICATES_IN_A_ROW
        while to_go > 0:
            batch: list[tuple[Any, list[str]]] = []
            duplicates = 0
            while len(batch) < min(self.n_jobs, to_go):
                trial = study.ask()
                overrides = self._configure(trial, searched, fixed)
                key = _setting(trial.params)
                if key in first_run:  # already run (or running): not again, and not counted as a trial
                    trial.set_user_attr("duplicate_of", first_run[key])
                    study.tell(trial, state=TrialState.PRUNED)
                    duplicates += 1
                    if batch or duplicates >= enough:
                        break  # run what is new first: its results may open new ground
                    continue
                first_run[key] = trial.number
                for name, value in {"job": next_job + len(batch), "overrides": overrides}.items():
                    trial.set_user_attr(name, value)
                batch.append((trial, overrides))
            if not batch:
                log.info("the sampler proposes only settings already tried: the search is complete")
                return
            returns = self.launcher.launch([overrides for _, overrides in batch], initial_job_idx=next_job)
            next_job += len(returns)
            for (trial, _), ret in zip(batch, returns):
                error = self._tell(study, trial, ret)
                if error is not None:
                    failures.append((trial.user_attrs["job"], error))
            n_ended += len(batch)
            to_go -= len(batch)
            if n_ended >= MIN_JOBS_BEFORE_GIVING_UP and len(failures) / n_ended > self.max_failure_rate:
                job, error = failures[-1]
                raise UserError(f"hydra.sweeper.max_failure_rate={self.max_failure_rate}: {len(failures)} of {n_ended} "
                                f"jobs failed (the last, job {job}: {error}); fix that, then rerun the same command "
                                "to continue the search")

    def _tell(self, study, trial, ret) -> Optional[str]:
        """One job's outcome to the study: its values, or a failed trial with the job's error (returned)."""
        TrialState = _optuna().trial.TrialState
        job = trial.user_attrs["job"]
        try:
            value = ret.return_value  # raises the job's exception when it failed
            values = [float(v) for v in (value if isinstance(value, (list, tuple, ListConfig)) else [value])]
            if len(values) != len(self.directions):
                raise UserError(f"job {job} returned {value!r}, not {len(self.directions)} values: is it train.py?")
        except Exception as e:  # a failed job is a failed trial, whatever it raised
            error = one_line(e)
            trial.set_user_attr("error", error)
            study.tell(trial, state=TrialState.FAIL)
            log.warning("trial %d (job %d) failed: %s", trial.number, job, error)
            return error
        path = self._job_dir(job) / TRIAL_FILE
        if path.exists():
            for key, v in json.loads(path.read_text()).items():
                trial.set_user_attr(key, v)
        study.tell(trial, values)
        log.info("trial %d (job %d) %s: %s", trial.number, job, trial.user_attrs.get("setting"),
                 ", ".join(f"{v:.4g}" for v in values))
        return None

    def _write_results(self, study) -> None:
        """optimization_results.yaml, as Hydra's Optuna sweeper writes it, with each trial's job."""
        TrialState = _optuna().trial.TrialState
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if all(math.isfinite(v) for v in t.values)]
        if len(self.directions) == 2:
            front = study.best_trials if done else []
            results = {"name": "optuna", "solutions": [{"job": t.user_attrs.get("job"), "params": t.params,
                                                        "values": t.values} for t in front]}
            log.info("Pareto front: %d of %d trials", len(front), len(done))
            for t in sorted(front, key=lambda t: t.values[1]):
                log.info("    job %s %s: %.4g s, %.4g bytes", t.user_attrs.get("job"), t.user_attrs.get("setting"),
                         *t.values)
        else:
            best = min(done, key=lambda t: t.values[0], default=None)
            results = {"name": "optuna", "best_params": best.params if best else None,
                       "best_value": best.values[0] if best else None,
                       "best_job": best.user_attrs.get("job") if best else None}
            if best is None:
                log.warning("no trial fits ac.target_memory_gib=%s", self.config.ac.target_memory_gib)
            else:
                log.info("fastest that fits: job %s %s, %.4g s", best.user_attrs.get("job"),
                         best.user_attrs.get("setting"), best.values[0])
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")


# --- reading a search back (the report, tests) -----------------------------------------------------------------

def trials(sweep_dir: Union[str, Path], study_name: Optional[str] = None) -> list[dict]:
    """Every trial of the study in <sweep_dir>/study.db: number, state, params, values, user attributes, and
    whether it is on the Pareto front (two objectives) or the best (one)."""
    optuna = _optuna()
    storage = f"sqlite:///{Path(sweep_dir).resolve() / 'study.db'}"
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if study_name is None:
        if len(names) != 1:
            raise UserError(f"{sweep_dir}: its study.db holds studies {names}; name one")
        study_name = names[0]
    study = optuna.load_study(study_name=study_name, storage=storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE
                and all(math.isfinite(v) for v in t.values)]
    if len(study.directions) == 2:
        best = {t.number for t in study.best_trials} if complete else set()
    else:
        best = {min(complete, key=lambda t: t.values[0]).number} if complete else set()
    return [{"number": t.number, "state": t.state.name, "params": t.params, "values": t.values,
             **t.user_attrs, "best": t.number in best} for t in study.trials]
