"""Read offline W&B runs back, without network, for tests.

An offline run (`wandb.init(mode="offline", dir=D)`) leaves `D/wandb/offline-run-<time>-<id>/run-<id>.wandb`:
a LevelDB-style log of `wandb.proto.wandb_internal_pb2.Record` protobufs, the same file `wandb sync` uploads.
wandb's own Python reader of that log (`wandb.sdk.internal.datastore`) left the SDK when its internals moved
to wandb-core (it is absent from 0.31), so the framing is read here (a few lines; the format is fixed) and
every record is decoded with wandb's protobuf classes.

    from tests.wandb_offline import find_offline_runs, read_offline_run, read_table

    run = read_offline_run(find_offline_runs(tmp_path)[0])
    losses = [row["loss"] for row in run["history"] if "loss" in row]
    table = read_table(run["media"]["report"][-1])   # {"columns": [...], "data": [[...], ...]}

`read_offline_run` returns a dict:
    id, project, entity, group, job_type, name, tags  -- from the run record
    config    -- the final config (init config plus later updates), values JSON-decoded
    history   -- one dict per `run.log` step, in order; nested keys ({"a": {"b": 1}}) come back nested, and
                 wandb's own `_step`, `_runtime`, `_timestamp` are kept
    summary   -- the final summary (every update applied in order)
    files     -- paths (relative to the run's `files/` dir) of the files the run saved or logged
    media     -- history/summary key -> absolute paths of the media files logged under it (tables, images, ...),
                 oldest first, each once
    exit_code -- the code `run.finish()` recorded, or None if the run never finished (still running, killed)
    dir       -- the offline run's directory
wandb's internal `_wandb` entries are left out of config and summary.
A log cut short (a run killed mid-write, or one wandb-core is still writing: see `read_offline_run`'s
timeout) is read up to its last complete record; a corrupt record raises ValueError.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib
from typing import Any

from wandb.proto import wandb_internal_pb2

# The log's framing (LevelDB log format with W&B's file header), as written by wandb-core.
_FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION = b":W&B", 0xBEE1, 0
_RECORD_HEADER = struct.Struct("<IHB")  # crc32 of (type byte + data), data length, chunk type
_BLOCK = 32768  # chunks never cross a block; a block tail too short for a header is zero padding
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find_offline_runs(root: str | os.PathLike) -> list[str]:
    """The `run-<id>.wandb` files of every offline run under `root` (any depth), sorted by path."""
    return sorted(glob.glob(os.path.join(os.fspath(root), "**", "offline-run-*", "run-*.wandb"), recursive=True))


def _chunks(data: bytes):
    """Yield (type, payload) of each complete chunk; stop quietly at a truncated tail."""
    pos = _FILE_HEADER.size
    while pos + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:
            pos += left
            continue
        crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a preallocated or cut file
            return
        start, pos = pos + _RECORD_HEADER.size, pos + _RECORD_HEADER.size + length
        if pos > len(data):
            return
        payload = data[start:pos]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"corrupt W&B log record at byte {start - _RECORD_HEADER.size}")
        yield kind, payload


def _records(path: str):
    """Yield each `Record` of a run log, reassembling records split over blocks."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _FILE_HEADER.size or _FILE_HEADER.unpack_from(data) != (_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION):
        raise ValueError(f"{path} is not a W&B run log (unknown header {data[:_FILE_HEADER.size]!r})")
    pending = b""
    for kind, payload in _chunks(data):
        if kind in (_FIRST, _MIDDLE):
            pending = (b"" if kind == _FIRST else pending) + payload
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + payload if kind == _LAST else payload)
        pending = b""
        yield record


def _path(item) -> list[str]:
    return list(item.nested_key) or [item.key]


def _value(item) -> Any:
    """An item's value: newer wandb may fill the typed `value` oneof, the classic field is `value_json`."""
    kind = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    if kind is None:
        return json.loads(item.value_json) if item.value_json else None
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def _set(target: dict, path: list[str], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[path[-1]] = value


def _remove(target: dict, path: list[str]) -> None:
    for key in path[:-1]:
        target = target.get(key)
        if not isinstance(target, dict):
            return
    target.pop(path[-1], None)


def _apply(target: dict, update) -> None:
    """Apply a Config/SummaryRecord-style message (`update` and `remove` items) to `target`."""
    for item in update.update:
        _set(target, _path(item), _value(item))
    for item in update.remove:
        _remove(target, _path(item))


def _media(value: Any):
    """Yield (relative path) of media files referenced by a logged value (wandb.Table, wandb.Image, ...)."""
    if isinstance(value, dict):
        if isinstance(value.get("_type"), str) and isinstance(value.get("path"), str):
            yield value["path"]
        for inner in value.values():
            yield from _media(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _media(inner)


def read_offline_run(path: str | os.PathLike, timeout: float = 10.0) -> dict[str, Any]:
    """Read one offline run: `path` is its `run-<id>.wandb` file or its `offline-run-*` directory.

    wandb-core finishes writing the log after `run.finish()` returns (and after the process that logged
    exits), so a log without its exit record is read again until it has one or `timeout` seconds have
    passed; then what is there is returned, with exit_code None (a killed run never gets one).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        logs = glob.glob(os.path.join(path, "run-*.wandb"))
        if len(logs) != 1:
            raise FileNotFoundError(f"expected one run-*.wandb in {path}, found {len(logs)}")
        path = logs[0]
    deadline = time.monotonic() + timeout
    while True:
        run = _read_log(path)
        if run["exit_code"] is not None or time.monotonic() >= deadline:
            return run
        time.sleep(0.1)


def _read_log(path: str) -> dict[str, Any]:
    run_dir = os.path.dirname(os.path.abspath(path))
    run: dict[str, Any] = {
        "id": None, "project": None, "entity": None, "group": None, "job_type": None, "name": None, "tags": [],
        "config": {}, "history": [], "summary": {}, "files": [], "media": {}, "exit_code": None, "dir": run_dir,
    }
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, project=r.project, entity=r.entity or None, group=r.run_group or None,
                       job_type=r.job_type or None, name=r.display_name or None, tags=list(r.tags))
            _apply(run["config"], r.config)
            _apply(run["summary"], r.summary)
        elif kind == "config":
            _apply(run["config"], record.config)
        elif kind == "summary":
            _apply(run["summary"], record.summary)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set(row, _path(item), _value(item))
            run["history"].append(row)
        elif kind == "files":
            run["files"] += [f.path for f in record.files.files if f.path not in run["files"]]
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    run["config"].pop("_wandb", None)
    run["summary"].pop("_wandb", None)
    for source in run["history"] + [run["summary"]]:
        for key, value in source.items():
            for rel in _media(value):
                paths = run["media"].setdefault(key, [])
                full = os.path.join(run_dir, "files", rel)
                if full not in paths:
                    paths.append(full)
    return run


def read_offline_runs(root: str | os.PathLike, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every offline run under `root` (see `find_offline_runs`), read."""
    return [read_offline_run(p, timeout) for p in find_offline_runs(root)]


def read_table(path: str | os.PathLike) -> dict[str, Any]:
    """A logged wandb.Table's file (a path from `media`) as {"columns": [...], "data": [[...], ...]}."""
    with open(path) as f:
        table = json.load(f)
    return {"columns": table["columns"], "data": table["data"]}
