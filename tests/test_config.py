"""The config: every option composes, every default lives in the schema, and --help shows the groups and options
that exist. Bad keys, types, choices and cross-field rules (each rejected in one line naming key and value): all
in tests/test_bad_input.py."""

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from membudget import options, schema
from membudget.errors import UserError
from membudget.launch import compose_config
from membudget.options import CONF_DIR
from membudget.rules import compile_enabled, validate
from tests.conftest import ROOT, compose_cfg

GROUPS = ["ac", "ac_point", "model", "parallelism", "data", "tokenizer", "logger", "experiment", "debug"]
# a world size each parallelism option fits (hsdp shards over groups of 8)
WORLD = {"hsdp": 8, "fsdp_tp": 4, "single": 1}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options.group_options(g)])
def test_every_group_option_composes_and_validates(group, option):
    prefix = "+" if group == "ac_point" else ""
    cfg = compose_cfg(f"{prefix}{group}={option}")
    validate(cfg, WORLD.get(option, 2) if group == "parallelism" else 1)


@pytest.mark.parametrize("auto", [("ac=memory_budget", "ac.memory_budget=auto"), ("ac=per_block", "ac.blocks=auto")])
@pytest.mark.parametrize("layout", ["parallelism=tp", "parallelism=fsdp_tp"])
def test_an_auto_setting_validates_under_tp(auto, layout):
    """An auto setting has no blocks before the planner chooses them: the rule against compiled full blocks under
    TP asks the choice (ac.memory_budget=auto under TP raised a ValueError, 'could not convert string to float')."""
    validate(compose_cfg(layout, *auto), world_size=4 if layout == "parallelism=fsdp_tp" else 2)


def test_the_schema_is_not_an_option():
    # only the whole run's schema is stored, as conf/config.yaml's base, never under an option group
    repo = ConfigStore.instance().repo
    assert {k for k, v in repo.items() if isinstance(v, dict)} <= {"hydra", "_dummy_empty_config_"}
    for override in ("ac=ac_schema", "model=model_schema", "data=data_schema"):
        with pytest.raises(ConfigCompositionException):
            compose_cfg(override)


def _schema_node(section: str) -> type:
    return next(f for f in dataclasses.fields(schema.RunConfig) if f.name == section).default_factory


def _schema_defaults(section: str) -> dict:
    return {f.name: f.default for f in dataclasses.fields(_schema_node(section)) if f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("group", ["ac", "model", "parallelism", "data", "tokenizer", "logger"])
def test_every_default_lives_in_the_schema(group):
    """A group option sets what makes it that option; no yaml restates a schema default (they drifted:
    optimizer.lr was 3e-4 in the schema, 3e-3 in conf/config.yaml)."""
    defaults = _schema_defaults(group)
    for option in options.group_options(group):
        values = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}
        # compared as the schema types them (yaml's 1e-5 is a string and 500000 an int; the schema's, floats)
        typed = OmegaConf.merge(OmegaConf.structured(_schema_node(group)),
                                OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
        restated = {k: v for k, v in values.items()
                    if k in defaults and typed[k] == defaults[k] and k not in ("name", "mode")}
        assert not restated, f"conf/{group}/{option}.yaml restates schema defaults {restated}"
    top = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    assert set(top) == {"defaults", "hydra"}, "conf/config.yaml sets section values: they belong in the schema"


def test_defaults():
    cfg = compose_cfg()
    assert cfg.ac.mode == "none" and cfg.model.name == "llama3_debug" and cfg.logger.name == "wandb"
    assert cfg.optimizer.lr == 3e-3 and not compile_enabled(cfg)
    budget = compose_cfg("ac=memory_budget")
    assert budget.ac.memory_budget == 0.5  # 1.0 would silently change nothing
    assert compile_enabled(budget) and budget.compile.backend == "inductor"


def test_ilp_solver_without_scipy_says_how_to_fix(monkeypatch):
    validate(compose_cfg("ac=memory_budget", "ac.solver=ilp"))  # scipy is installed here
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(UserError, match="pip install scipy"):
        validate(compose_cfg("ac=memory_budget", "ac.solver=ilp"))


def test_per_block_budgets_parse_and_label():
    assert schema.parse_block_budgets("0.3*2+0.6*2") == [0.3, 0.3, 0.6, 0.6]
    assert schema.parse_block_budgets("0.2+0.4") == [0.2, 0.4]
    assert schema.compact_budgets([0.3, 0.3, 0.6, 0.6]) == "0.3*2+0.6*2"
    assert schema.compact_budgets([0.5] * 4) == 0.5
    cfg = compose_cfg("ac=memory_budget", "ac.memory_budget=0.3*2+0.6*2")
    validate(cfg)
    assert schema.block_budgets(cfg.ac, 4) == [0.3, 0.3, 0.6, 0.6]
    assert schema.ac_label(cfg.ac) == "memory_budget 0.3*2+0.6*2"
    assert [schema.ac_label(compose_cfg(*o).ac) for o in (["ac=none"], ["ac=selective"], ["ac=full"],
            ["ac=selective", "ac.selective_option=2"], ["ac=memory_budget"])] == [
        "none", "selective op", "full", "selective every 2", "memory_budget 0.5"]
    # the report reads a job's config.yaml back as a plain dict: the same label
    assert schema.ac_label({"mode": "memory_budget", "memory_budget": 0.0}) == "memory_budget 0.0"


def test_hints_name_options_that_exist():
    assert options.option_for("tokenizer", "name", "tiktoken") == "tokenizer=llama3"
    assert options.option_for("data", "name", "hf") == "data=c4"
    assert "data=fineweb_edu" in options.choices("data")


def test_help_shows_the_groups_and_options_that_exist():
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    for group in GROUPS:
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"{group}: "))
        assert line.split(": ", 1)[1].split(", ") == list(options.group_options(group)), group
    assert "ac_schema" not in done.stdout and "ac_point" in done.stdout
    # the groups' own lines above Hydra's list name every option too (a group's line and those indented below it)
    said = done.stdout.split("Config groups")[1].split("Sections")[0]
    for group in ("model", "ac", "parallelism", "data", "tokenizer", "logger", "experiment", "debug"):
        line = re.search(rf"^  {group} +(.*(?:\n {{6,}}.*)*)", said, re.M).group(1)
        missing = [o for o in options.group_options(group) if not re.search(rf"\b{o}\b", line)]
        assert not missing, (group, missing)
    assert "python train.py ac=memory_budget ac.memory_budget=0.4" in done.stdout


@pytest.mark.parametrize("overrides", [
    (), ("logger=none", "train.steps=3", "train.seq_len=32"), ("ac=memory_budget", "ac.memory_budget=auto"),
    ("model=llama3_8b", "parallelism=fsdp", "parallelism.dp_shard=8", "plan.budgets=[0.1,0.2]"),
    ("+ac_point=budget_0.5", "model.n_layers=2"), ("experiment=budget_sweep", "compile.enabled=null"),
    ("debug=fast", "+train.extra=1", "++train.steps=5", "~ac.solver"), ("ac=per_block", "ac.blocks='full*2'"),
    # refused: each with the exception and message Hydra's compose gives
    ("train.steps=abc",), ("nonexistent=1",), ("ac=bogus",), ("+train.steps=3",), ("train.steps=1,2",),
    ("train.steps=range(1,3)",), ("ac.mode=bogus", "ac=full"),
])
def test_the_tests_compose_as_hydra_does(overrides):
    """compose_cfg composes the groups once and applies the other overrides with Hydra's own second stage: the
    same config as Hydra's compose (values, types, struct flag), or the same error."""

    def outcome(compose):
        try:
            cfg = compose()
        except Exception as e:  # noqa: BLE001 (the exception is the outcome compared)
            return type(e), str(e)
        return OmegaConf.to_yaml(cfg), repr(cfg), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg)

    assert outcome(lambda: compose_cfg(*overrides)) == outcome(lambda: compose_config(overrides))
