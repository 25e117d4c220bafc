"""The sweep report (membudget.report), the experiment presets, and the offline W&B reader it is tested with.

Most tests build synthetic multirun dirs in the trainer's formats; one runs a real (tiny, CPU)
`python train.py -m experiment=ac_modes` sweep end to end.
"""

import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from membudget import report
from tests.conftest import FAST_COMPILE, ROOT, run_train
from tests.wandb_offline import find_offline_runs, read_offline_run, read_offline_runs, read_table

MiB = 2**20


def _write_job(sweep: Path, num: int, ac: dict, *, steps=6, loss_shift=0.0, step_time=0.1, act_mib=100,
               status="completed", summary=True, wandb=None, overrides=None):
    """A job dir as the trainer writes it: .hydra/{config,overrides}.yaml, metrics.jsonl, summary.json."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    config = {"model": {"name": "llama3_debug"}, "ac": ac, "compile": {"enabled": True, "backend": "inductor"},
              "train": {"seed": 0, "steps": steps}, "logger": {"name": "wandb" if wandb else "none"}}
    OmegaConf.save(config, job / ".hydra" / "config.yaml")
    OmegaConf.save(overrides or [f"ac={ac['mode']}"], job / ".hydra" / "overrides.yaml")
    losses = [5.0 - 0.3 * s + loss_shift for s in range(1, steps + 1)]
    with open(job / "metrics.jsonl", "w") as f:
        for s, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": s, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000 / step_time,
                                "step_time_s": step_time, "activation_bytes": act_mib * MiB,
                                "peak_memory_bytes": 2 * act_mib * MiB, "mfu": None}) + "\n")
    if summary:
        (job / "summary.json").write_text(json.dumps({
            "status": status, **({"error": "RuntimeError: boom"} if status == "failed" else {}),
            "num_params": 1000, "steps": steps, "final_loss": losses[-1], "median_tokens_per_s": 1000 / step_time,
            "median_step_time_s": step_time, "peak_memory_bytes": 2 * act_mib * MiB, "activation_bytes": act_mib * MiB,
            "mfu": None, "ac_mode": ac["mode"], "memory_budget": ac.get("memory_budget"),
            "selective_option": ac.get("selective_option"), "wandb": wandb, "config": config,
        }))


def _ac_modes_sweep(tmp_path, **shifts) -> Path:
    """A finished `experiment=ac_modes` sweep; shifts={"full": 0.5} moves that run's loss curve."""
    sweep = tmp_path / "sweep"
    for num, (mode, time, mib) in enumerate([("none", 0.10, 400), ("full", 0.14, 40), ("selective", 0.12, 150),
                                             ("memory_budget", 0.11, 200)]):
        ac = {"mode": mode, "memory_budget": 0.5, "selective_option": "op"}
        _write_job(sweep, num, ac, step_time=time, act_mib=mib, loss_shift=shifts.get(mode, 0.0))
    return sweep


def _read_csv(sweep: Path) -> dict[str, dict[str, str]]:
    with open(sweep / "report.csv") as f:
        return {row["ac_mode"]: row for row in csv.DictReader(f)}


def _assert_image(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(path).shape[:2]
    assert height > 100 and width > 100
    assert b"<svg" in path.with_suffix(".svg").read_bytes()[:1000]


def test_report_rows_plots_and_verdict(tmp_path):
    sweep = _ac_modes_sweep(tmp_path)
    assert report.main([str(sweep), "--no-wandb", "--strict"]) == 0

    rows = _read_csv(sweep)
    assert set(rows) == {"none", "full", "selective", "memory_budget"}
    assert rows["memory_budget"]["memory_budget"] == "0.5" and rows["full"]["memory_budget"] == ""
    assert rows["selective"]["selective_option"] == "op" and rows["none"]["selective_option"] == ""
    assert float(rows["full"]["step_time_vs_none"]) == pytest.approx(1.4)
    assert rows["full"]["mfu"] == ""  # null MFU stays blank
    assert all(float(r["max_abs_loss_diff"]) == 0 and r["loss_flagged"] == "False" for r in rows.values())
    for name in ("loss", "memory_vs_time"):
        _assert_image(sweep / f"{name}.png")
    assert not (sweep / "budget.png").exists()  # one budget is no budget sweep

    md = (sweep / "report.md").read_text()
    assert "FLAGGED" not in md and "Not finished" not in md
    # The Pareto front: full (least memory), selective, memory_budget, none (fastest); nothing dominated here.
    front = md.split("Pareto front")[1].split("\n\n")[0]
    assert [line.split(":")[0] for line in front.splitlines()[1:]] == [
        "- full", "- selective op", "- memory_budget 0.5", "- none"]


def test_pareto_front_drops_dominated_and_flagged():
    def row(name, mib, time, flagged=False):
        return {"run": name, "activation_bytes": mib, "median_step_time_s": time, "loss_flagged": flagged}

    rows = [row("a", 10, 3), row("b", 20, 2), row("dominated", 25, 2.5), row("wrong", 5, 1, flagged=True)]
    assert [r["run"] for r in report.pareto_front(rows)] == ["a", "b"]


def test_shifted_loss_is_flagged_and_strict_fails(tmp_path, capsys):
    sweep = _ac_modes_sweep(tmp_path, selective=0.2)  # 0.2 > 0.01 * (1 + loss ~ 3..5)
    assert report.main([str(sweep), "--no-wandb"]) == 0
    assert report.main([str(sweep), "--no-wandb", "--strict"]) == 1
    rows = _read_csv(sweep)
    assert rows["selective"]["loss_flagged"] == "True"
    assert float(rows["selective"]["max_abs_loss_diff"]) == pytest.approx(0.2)
    assert rows["full"]["loss_flagged"] == "False"
    assert "**FLAGGED**" in (sweep / "report.md").read_text()
    assert "selective op" in capsys.readouterr().out
    # A looser tolerance accepts it: 0.2 <= 0.1 * (1 + 3.2)
    assert report.main([str(sweep), "--no-wandb", "--strict", "--tolerance", "0.1"]) == 0


def test_nan_loss_is_flagged(tmp_path):
    sweep = _ac_modes_sweep(tmp_path, full=float("nan"))
    assert report.main([str(sweep), "--no-wandb", "--strict"]) == 1
    assert _read_csv(sweep)["full"]["loss_flagged"] == "True"


def test_without_none_run_comparison_is_skipped(tmp_path):
    sweep = _ac_modes_sweep(tmp_path)
    shutil.rmtree(sweep / "0")
    assert report.main([str(sweep), "--no-wandb"]) == 0
    assert "No completed ac=none run" in (sweep / "report.md").read_text()
    assert all(r["max_abs_loss_diff"] == "" and r["step_time_vs_none"] == "" for r in _read_csv(sweep).values())
    assert report.main([str(sweep), "--no-wandb", "--strict"]) == 1  # correctness not shown


def test_unfinished_jobs_are_listed(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    # multirun.yaml as Hydra's basic sweeper writes it: 5 jobs, of which 2 never started.
    OmegaConf.save({"hydra": {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                          "params": {"ac": "none,full,selective,memory_budget"}},
                              "overrides": {"task": ["train.seed=0,1"]}}}, sweep / "multirun.yaml")
    _write_job(sweep, 0, {"mode": "none"}, overrides=["ac=none", "train.seed=0"])
    _write_job(sweep, 1, {"mode": "none"}, overrides=["ac=none", "train.seed=1"], status="failed")
    _write_job(sweep, 2, {"mode": "full"}, overrides=["ac=full", "train.seed=0"], summary=False)
    assert report.main([str(sweep), "--no-wandb"]) == 0
    md = (sweep / "report.md").read_text()
    not_finished = md.split("## Not finished")[1].split("##")[0]
    assert "job 1 (ac=none train.seed=1): failed: RuntimeError: boom" in not_finished
    assert "job 2 (ac=full train.seed=0): running or stopped: last logged step 6 of 6" in not_finished
    assert "job 3 (ac=full train.seed=1): not started" in not_finished
    assert "job 7 (ac=memory_budget train.seed=1): not started" in not_finished
    assert list(_read_csv(sweep)) == ["none"]


def test_budget_sweep_plots(tmp_path):
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "none"}, step_time=0.10, act_mib=400)
    _write_job(sweep, 1, {"mode": "full"}, step_time=0.14, act_mib=40)
    for i, budget in enumerate([0.0, 0.5, 1.0], start=2):
        _write_job(sweep, i, {"mode": "memory_budget", "memory_budget": budget},
                   step_time=0.14 - 0.04 * budget, act_mib=40 + 360 * budget)
    assert report.main([str(sweep), "--no-wandb"]) == 0
    _assert_image(sweep / "budget.png")
    with open(sweep / "report.csv") as f:
        assert [r["memory_budget"] for r in csv.DictReader(f)] == ["", "", "0.0", "0.5", "1.0"]


def _sweep_jobs(experiment: str) -> list[dict]:
    """The composed config of every job of `python train.py -m experiment=<experiment>`."""
    from membudget.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        params = compose("config", [f"experiment={experiment}"], return_hydra_config=True).hydra.sweeper.params
        parsed = OverridesParser.create().parse_overrides(
            [f"{k}={v}" for k, v in params.items()] + [f"experiment={experiment}"])
        [jobs] = BasicSweeper.split_arguments(parsed, None)
        return [compose("config", job) for job in jobs]


# The presets set compile.enabled: true; it only holds if conf/config.yaml merges `experiment` after `_self_`.
COMPILED = "compile.enabled of the preset was overridden: conf/config.yaml must list `experiment: null` after `_self_`"


def test_ac_modes_preset():
    jobs = _sweep_jobs("ac_modes")
    assert [c.ac.mode for c in jobs] == ["none", "full", "selective", "memory_budget"]
    assert all(c.compile.enabled is True for c in jobs), COMPILED
    assert all(c.compile.backend == "inductor" for c in jobs)
    assert len({(c.train.seed, c.data.name, c.model.name) for c in jobs}) == 1


def test_budget_sweep_preset():
    jobs = _sweep_jobs("budget_sweep")
    points = [(c.ac.mode, c.ac.memory_budget if c.ac.mode == "memory_budget" else None) for c in jobs]
    assert points == [("none", None), ("full", None), ("selective", None)] + [
        ("memory_budget", b / 10) for b in range(11)]  # exactly 0.3, not 0.30000000000000004
    assert all(c.compile.enabled is True for c in jobs), COMPILED
    assert all(c.compile.backend == "inductor" for c in jobs)


def _offline_run(tmp_path, **kwargs):
    import wandb

    run = wandb.init(mode="offline", dir=tmp_path, project="proj", group="grp", job_type="train",
                     tags=["t1", "t2"], config={"lr": 0.1, "model": {"dim": 64}}, **kwargs)
    for step in range(1, 4):
        run.log({"loss": 3.0 / step, "step": step, "nested": {"x": step}, "note": None})
    run.log({"big": "x" * 100_000})  # one record over several 32 KiB blocks
    run.log({"table": wandb.Table(columns=["a", "b"], data=[[1, "x"], [2, None]])})
    run.summary["final"] = "done"
    run.finish()
    return find_offline_runs(tmp_path)


def test_wandb_offline_reader(tmp_path):
    [path] = _offline_run(tmp_path)
    run = read_offline_run(path)
    assert (run["project"], run["group"], run["job_type"], run["tags"]) == ("proj", "grp", "train", ["t1", "t2"])
    assert run["config"] == {"lr": 0.1, "model": {"dim": 64}}
    losses = [row for row in run["history"] if "loss" in row]
    assert [(r["step"], r["loss"], r["nested"], r["note"], r["_step"]) for r in losses] == [
        (1, 3.0, {"x": 1}, None, 0), (2, 1.5, {"x": 2}, None, 1), (3, 1.0, {"x": 3}, None, 2)]
    assert run["history"][3]["big"] == "x" * 100_000
    assert run["summary"]["final"] == "done" and run["summary"]["loss"] == 1.0
    assert run["exit_code"] == 0 and run["id"] in path
    [table_path] = run["media"]["table"]
    assert any(table_path.endswith(f) for f in run["files"])
    assert read_table(table_path) == {"columns": ["a", "b"], "data": [[1, "x"], [2, None]]}
    assert read_offline_run(os.path.dirname(path))["id"] == run["id"]  # the run dir works too


def test_wandb_offline_reader_truncated_log(tmp_path):
    [path] = _offline_run(tmp_path)
    data = Path(path).read_bytes()
    cut = Path(path).with_name("run-cut.wandb")
    cut.write_bytes(data[:40_000])  # killed mid-run: inside the big record
    run = read_offline_run(cut, timeout=0)
    assert run["exit_code"] is None and len(run["history"]) == 3
    corrupt = bytearray(data)
    corrupt[200] ^= 0xFF
    cut.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="corrupt"):
        read_offline_run(cut, timeout=0)


def test_report_logs_summary_run_to_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sweep = tmp_path / "sweep"
    info = {"project": "proj", "group": "sweep-group", "id": "abc", "dir": "unused"}
    _write_job(sweep, 0, {"mode": "none"}, wandb=info)
    _write_job(sweep, 1, {"mode": "full"}, wandb=info, act_mib=40, step_time=0.14)
    assert report.main([str(sweep)]) == 0
    [run] = read_offline_runs(sweep)
    assert (run["project"], run["group"], run["job_type"]) == ("proj", "sweep-group", "report")
    table = read_table(run["media"]["report"][0])
    assert table["columns"] == report.COLUMNS
    assert [row[table["columns"].index("ac_mode")] for row in table["data"]] == ["none", "full"]
    assert {"loss", "memory_vs_time"} <= set(run["media"])
    assert run["summary"]["pareto_front"] == ["full", "none"]


@pytest.mark.timeout(300)
def test_ac_modes_sweep_end_to_end(tmp_path):
    """A real CPU sweep of the debug model: four runs, AC keeps the loss, tampering is caught."""
    sweep = tmp_path / "sweep"
    done = run_train(sweep, "experiment=ac_modes", "train.steps=3", "train.seq_len=64", "train.global_batch_size=2",
                     "train.progress=off", FAST_COMPILE, "logger=wandb", multirun=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report.main([str(sweep), "--strict"]) == 0

    rows = _read_csv(sweep)
    assert set(rows) == {"none", "full", "selective", "memory_budget"}
    for mode in ("full", "selective"):
        assert float(rows[mode]["max_abs_loss_diff"]) < report.TOLERANCE
        assert rows[mode]["loss_flagged"] == "False"
    assert int(rows["full"]["activation_bytes"]) < int(rows["none"]["activation_bytes"])
    for name in ("loss", "memory_vs_time"):
        _assert_image(sweep / f"{name}.png")

    runs = read_offline_runs(sweep)
    training = [r for r in runs if r["job_type"] != "report"]
    [summary_run] = [r for r in runs if r["job_type"] == "report"]
    assert len(training) == 4 and len({r["group"] for r in runs}) == 1
    assert all(len([h for h in r["history"] if "loss" in h]) == 3 for r in training)
    table = read_table(summary_run["media"]["report"][0])
    assert len(table["data"]) == 4

    # Tamper with one run's losses: the report must flag it and --strict must fail.
    metrics = sweep / "2" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**row, "loss": row["loss"] + 0.5}) + "\n" for row in lines))
    assert report.main([str(sweep), "--strict", "--no-wandb"]) == 1
    assert _read_csv(sweep)["selective"]["loss_flagged"] == "True"


def test_workspace_script_explains_what_is_missing():
    if importlib.util.find_spec("wandb_workspaces"):
        pytest.skip("wandb-workspaces is installed: the script would go online")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "wandb_workspace.py"), "--group", "g"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "pip install wandb-workspaces" in done.stderr
