import pytest
from hydra.errors import ConfigCompositionException

from membudget.config import UserError, compile_enabled, validate
from tests.conftest import CONF, compose_cfg, run_train

GROUPS = ["ac", "model", "parallelism", "data", "tokenizer", "logger", "experiment"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose_cfg(f"{group}={option}")
    # a world size each parallelism option fits (hsdp shards over groups of 8)
    validate(cfg, {"hsdp": 8, "fsdp_tp": 4, "single": 1}.get(option, 2) if group == "parallelism" else 1)


def test_every_group_has_its_options():
    assert _options("ac") == ["full", "memory_budget", "none", "selective"]
    assert {"llama3_debug", "llama3_8b"} <= set(_options("model"))
    assert {"wandb", "none"} <= set(_options("logger"))


@pytest.mark.parametrize("launcher", ["slurm", "slurm_local"])
def test_launcher_presets_compose(launcher):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert "submitit" in cfg.hydra.launcher._target_


def test_defaults():
    cfg = compose_cfg()
    assert cfg.ac.mode == "none" and cfg.model.name == "llama3_debug" and cfg.logger.name == "wandb"
    assert not compile_enabled(cfg)
    budget = compose_cfg("ac=memory_budget")
    assert budget.ac.memory_budget == 0.5  # 1.0 would silently change nothing
    assert compile_enabled(budget) and budget.compile.backend == "inductor"


@pytest.mark.parametrize("override", ["ac.memroy_budget=0.3", "train.steps=abc", "model.dim=1.5", "ac=nonsense",
                                      "train.sequence_length=8"])
def test_schema_rejects_misspelt_keys_and_wrong_types(override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


@pytest.mark.parametrize("overrides,key", [
    (["ac=memory_budget", "ac.memory_budget=1.5"], "ac.memory_budget"),
    (["ac=memory_budget", "ac.memory_budget=-0.1"], "ac.memory_budget"),
    (["ac=memory_budget", "ac.memory_budget=abc"], "ac.memory_budget"),
    (["ac=memory_budget", "compile.enabled=false"], "compile.enabled"),
    (["ac=memory_budget", "compile.backend=aot_eager"], "compile.backend"),
    (["ac=memory_budget", "compile.backend=eager"], "compile.backend"),
    (["ac=memory_budget", "ac.solver=magic"], "ac.solver"),
    (["ac=memory_budget", "ac.runtime_estimator=guess"], "ac.runtime_estimator"),
    (["ac=selective", "ac.selective_option=0"], "ac.selective_option"),
    (["ac=selective", "ac.selective_option=sometimes"], "ac.selective_option"),
    (["compile.backend=tvm"], "compile.backend"),
    (["train.micro_batch_size=3"], "train.micro_batch_size"),
    (["train.seq_len=4096"], "train.seq_len"),
    (["train.device=tpu"], "train.device"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
])
def test_cross_field_rules_name_key_value_and_fix(overrides, key):
    cfg = compose_cfg(*overrides)
    with pytest.raises(UserError) as err:
        validate(cfg)
    message = str(err.value)
    assert message.startswith(key + "=") and "\n" not in message
    value = overrides[-1].split("=", 1)[1]
    assert value.lower() in message.lower()


def test_ilp_solver_without_scipy_says_how_to_fix(monkeypatch):
    validate(compose_cfg("ac=memory_budget", "ac.solver=ilp"))  # scipy is installed here
    monkeypatch.setitem(__import__("sys").modules, "scipy", None)
    monkeypatch.setitem(__import__("sys").modules, "scipy.optimize", None)
    with pytest.raises(UserError, match="pip install scipy"):
        validate(compose_cfg("ac=memory_budget", "ac.solver=ilp"))


@pytest.mark.parametrize("overrides,expected", [
    (["ac=memory_budget", "compile.enabled=false"], "compile.enabled=False"),
    (["ac=memory_budget", "ac.memory_budget=1.5"], "ac.memory_budget=1.5"),
])
def test_train_py_rejects_bad_config_in_one_line(tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *overrides, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    # nothing heavy started: no metrics, no summary, no W&B run
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "wandb").exists()
