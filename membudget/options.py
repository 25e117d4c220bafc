"""The config groups' options as they exist under conf/, so that error messages and the app's help suggest
only overrides that compose (`tokenizer=llama3`, not the value `tiktoken` it sets)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import yaml

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@functools.cache
def group_options(group: str) -> tuple[str, ...]:
    """The options of a config group: its yaml files' names, sorted."""
    return tuple(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))


@functools.cache
def _option_values(group: str) -> dict[str, dict]:
    return {option: yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}
            for option in group_options(group)}


def options_setting(group: str, key: str, value) -> list[str]:
    """The options of `group` whose yaml sets `key` to `value` (data, name, hf: c4 and fineweb_edu)."""
    return [o for o, values in _option_values(group).items() if str(values.get(key)) == str(value)]


def option_for(group: str, key: str, value) -> Optional[str]:
    """`group=option` for the first option that sets `key: value`, e.g. tokenizer name tiktoken ->
    "tokenizer=llama3"; None when no option does."""
    found = options_setting(group, key, value)
    return f"{group}={found[0]}" if found else None


def choices(group: str) -> str:
    """"ac=full, ac=none, ..." : every option of a group as an override."""
    return ", ".join(f"{group}={o}" for o in group_options(group))

