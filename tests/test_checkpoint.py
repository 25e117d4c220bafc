"""Checkpoints: a resumed run reproduces the uninterrupted one bit for bit (also FSDP under torchrun, sharded on
disk), and on another world size to fp32 rounding; a killed or failed save never costs the last good checkpoint;
a damaged checkpoint is never loaded: it is skipped for the newest intact one; a non-finite state is never saved;
only the last K are kept."""

import itertools
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import membudget.checkpoint as checkpoint_module
from membudget.checkpoint import MANIFEST, Checkpointer, config_changes, read_train_state, verify
from membudget.errors import UserError
from membudget.schema import CheckpointConfig
from tests import checkpoint_driver
from tests.checkpoint_driver import SMALL, Run, scope
from tests.conftest import FAST_COMPILE, compose_cfg, read_metrics, run_ranks, train_here, train_py_ranks


@pytest.mark.parametrize("ac", ["ac=none", pytest.param("ac=full", marks=pytest.mark.slow),
                                pytest.param("ac=memory_budget", marks=pytest.mark.slow)])
def test_resumed_run_matches_uninterrupted_run_bitwise(tmp_path, ac):
    cfg = compose_cfg(*SMALL, ac, FAST_COMPILE)
    checkpointer = Checkpointer(tmp_path, cfg.checkpoint)
    with scope(cfg):
        run = Run.build(cfg)
        run.train(3)
        torch.rand(7)  # RNG drawn during training (dropout, sampling) moves it away from the seeded state
        run.save(checkpointer, 3)
        rand_after_save = torch.rand(4)
        uninterrupted = run.train(3)

        resumed = Run.build(cfg)
        path, state = resumed.load(checkpointer)
        assert state["step"] == 3 and state["extra"] == {"data": {"step": 3, "epoch": 0, "doc": 0, "offset": 0}}
        assert torch.equal(torch.rand(4), rand_after_save)
        assert resumed.train(3) == uninterrupted
    assert resumed.scheduler.get_last_lr() == run.scheduler.get_last_lr()
    for a, b in zip(resumed.model.parameters(), run.model.parameters(), strict=True):
        assert torch.equal(a, b)
    if ac == "ac=memory_budget":  # the budget (0.5) took effect: the compiled blocks keep less than at 1.0
        whole = compose_cfg(*SMALL, ac, FAST_COMPILE, "ac.memory_budget=1.0")
        with scope(whole):
            unbudgeted = Run.build(whole)
            unbudgeted.train(1)
        assert run.activation_bytes[0] < 0.8 * unbudgeted.activation_bytes[0], (run.activation_bytes,
                                                                              unbudgeted.activation_bytes)


def tiny_run():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def killed(*args, **kwargs):
    raise KeyboardInterrupt("killed")


@pytest.mark.parametrize("cut", ["_write_durably", "_fsync_dir"])  # mid-write, and just before the rename
def test_killed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, cut):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=1))
    good = checkpointer.save(1, *tiny_run(), extra={"rows": 1})
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, cut, killed)
        with pytest.raises(KeyboardInterrupt):
            checkpointer.save(2, *tiny_run(), extra={"rows": 2})
    assert (checkpointer.dir / ".tmp_step_0000002").is_dir()
    assert checkpointer.latest() == good
    assert checkpointer.restore(*tiny_run())[1]["extra"] == {"rows": 1}

    checkpointer.save(3, *tiny_run(), extra={"rows": 3})
    assert sorted(p.name for p in checkpointer.dir.iterdir()) == ["step_0000003"]


def test_a_save_that_fails_but_not_for_the_disk_does_not_send_the_user_to_free_space(tmp_path, monkeypatch):
    """DCP's own error (a global plan whose shards do not cover a tensor, as when a rank held another's shards):
    one line with the error, the earlier checkpoint kept, and no advice to free space."""
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=2))
    good = checkpointer.save(1, *tiny_run(), extra={})

    def invalid_plan(*args, **kwargs):
        raise ValueError("Failed to validate global plan")

    monkeypatch.setattr(checkpoint_module.dcp, "save", invalid_plan)
    with pytest.raises(UserError) as err:
        checkpointer.save(2, *tiny_run(), extra={})
    message = str(err.value)
    assert "\n" not in message and "(ValueError: Failed to validate global plan)" in message
    assert f"(latest {good})" in message and "free space" not in message and "report it" in message
    assert checkpointer.saved() == [good]


def test_keeps_the_last_k_checkpoints_and_resaves_a_step(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=2))
    for step in (1, 2, 3, 4):
        checkpointer.save(step, *tiny_run(), extra={})
    assert [p.name for p in checkpointer.saved()] == ["step_0000003", "step_0000004"]
    # after resuming from step 3, step 4 is written again: the new one replaces the old
    checkpointer.save(4, *tiny_run(), extra={"again": True})
    assert sorted(p.name for p in checkpointer.dir.iterdir()) == ["step_0000003", "step_0000004"]
    assert checkpointer.restore(*tiny_run())[1]["extra"] == {"again": True}


def test_due_every_n_steps_and_at_the_last_step(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every_steps=4))
    assert [s for s in range(1, 11) if checkpointer.due(s, 10)] == [4, 8, 10]
    assert not Checkpointer(tmp_path, CheckpointConfig(enabled=False)).due(10, 10)


def test_non_finite_state_is_never_saved(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    model, optimizer, scheduler = tiny_run()
    checkpointer.save(1, model, optimizer, scheduler, extra={})
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(UserError, match=r"^checkpoint step 2: the model or optimizer state holds NaN or inf"):
        checkpointer.save(2, model, optimizer, scheduler, extra={})
    assert [p.name for p in checkpointer.saved()] == ["step_0000001"] and not list(checkpointer.dir.glob(".tmp*"))


def test_unwritable_checkpoint_dir_fails_early_in_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    checkpointer = Checkpointer(blocker / "run", CheckpointConfig())
    with pytest.raises(UserError) as err:
        checkpointer.check_writable()
    assert str(blocker / "run" / "checkpoints") in str(err.value) and "\n" not in str(err.value)
    Checkpointer(blocker / "run", CheckpointConfig(enabled=False)).check_writable()  # nothing to write


# --- damaged checkpoints ---------------------------------------------------------------------------------------

DAMAGE = ("truncate", "delete", "garbage", "bitflip")


def corrupt(path: Path, rng: random.Random, name: str | None = None, kind: str | None = None) -> str:
    """One damage to a checkpoint dir: truncate, delete, garbage or flipped bits (`kind`, else a random one), in
    its file `name` (else a random one)."""
    target = path / name if name else rng.choice(sorted(p for p in path.iterdir() if p.is_file()))
    kind = kind or rng.choice(DAMAGE)
    data = target.read_bytes()
    if kind == "delete":
        target.unlink()
    elif kind == "truncate":
        target.write_bytes(data[:rng.randrange(len(data))])
    elif kind == "garbage":
        target.write_bytes(bytes(rng.randrange(256) for _ in range(max(1, len(data)))))
    else:
        flipped = bytearray(data)
        i = rng.randrange(len(flipped))
        flipped[i] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(flipped))
    return f"{kind} {target.name}"


def test_every_damage_is_found_by_the_manifest(tmp_path):
    """Sizes and CRC32s of every file, written last: truncation, deletion, garbage and single flipped bits in
    .distcp, .metadata, train_state.json, the RNG states or the manifest itself are all caught."""
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=1))
    good = checkpointer.save(1, *tiny_run(), extra={})
    assert verify(good) is None
    rng = random.Random(0)
    damaged = set()
    for i in range(40):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(good, copy)
        what = corrupt(copy, rng)
        assert verify(copy) is not None, what
        damaged.add(what.split()[1])
    assert {".metadata", "__0_0.distcp", "train_state.json", "rng_rank0.pt", MANIFEST} <= damaged


@pytest.mark.parametrize("damage", [
    ("crc32", "brc32"), ("bytes", "cytes"),  # a flipped bit in a key: still valid JSON
    ('"files": {', '"files": [{'), ('"files": {', '"filet": {'),
])
def test_a_manifest_that_is_valid_json_of_another_shape_is_damage_not_a_crash(tmp_path, damage):
    """A flipped bit can leave the manifest valid JSON of another shape: verify names it (resume then falls back
    to an older checkpoint), it never raises."""
    good = Checkpointer(tmp_path, CheckpointConfig(keep=1)).save(1, *tiny_run(), extra={})
    manifest = good / MANIFEST
    text = manifest.read_text()
    old, new = damage
    assert old in text
    manifest.write_text(text.replace(old, new, 1))
    assert verify(good).startswith("unreadable manifest.json")
    assert Checkpointer(tmp_path, CheckpointConfig(keep=1)).latest() is None


def test_every_single_flipped_bit_of_the_manifest_is_found(tmp_path):
    """Each of the manifest's bits flipped in turn (the random damages above reach only some): every one is found,
    none raises."""
    good = Checkpointer(tmp_path, CheckpointConfig(keep=1)).save(1, *tiny_run(), extra={})
    manifest = good / MANIFEST
    data = manifest.read_bytes()
    missed = []
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        manifest.write_bytes(bytes(flipped))
        if verify(good) is None:
            missed.append(bytes(flipped).decode(errors="replace"))
    manifest.write_bytes(data)
    assert verify(good) is None and not missed, missed[:1]


@pytest.mark.slow
def test_random_damage_resumes_from_the_newest_intact_checkpoint(tmp_path):
    """Every kind of damage to each file of the newest checkpoint (20, at seeded random places): each resume uses
    the one before it and reproduces the uninterrupted run's losses; damage to both is one line. Zero tracebacks,
    zero silent loads."""
    cfg = compose_cfg(*SMALL)
    uninterrupted = Run.build(cfg)
    reference = uninterrupted.train(6)
    source = tmp_path / "source"
    checkpointer = Checkpointer(source, CheckpointConfig(keep=2))
    run = Run.build(cfg)
    run.train(2)
    run.save(checkpointer, 2)
    run.train(2)
    run.save(checkpointer, 4)
    files = sorted(p.name for p in (source / "checkpoints" / "step_0000004").iterdir())
    assert files == [".metadata", "__0_0.distcp", MANIFEST, "rng_rank0.pt", "train_state.json"]
    # seeded per trial: where the damage lands does not depend on the sizes of the files damaged before (DCP's
    # .metadata holds the checkpoint's path, so its size is tmp_path's)
    for i, (name, kind) in enumerate(itertools.product(files, DAMAGE)):
        trial = tmp_path / f"trial{i}"
        shutil.copytree(source, trial)
        what = corrupt(trial / "checkpoints" / "step_0000004", random.Random(i), name, kind)
        resumed = Run.build(cfg)
        path, state = resumed.load(Checkpointer(trial, CheckpointConfig(keep=2)))
        assert path.name == "step_0000002" and state["step"] == 2, what
        assert resumed.train(4) == reference[2:], what
    rng = random.Random(1)
    both = tmp_path / "both"
    shutil.copytree(source, both)
    for step in (2, 4):
        corrupt(both / "checkpoints" / f"step_{step:07d}", rng)
    with pytest.raises(UserError) as err:
        Run.build(cfg).load(Checkpointer(both, CheckpointConfig()))
    message = str(err.value)
    assert message.startswith("checkpoint.resume='auto': no intact checkpoint") and "\n" not in message
    assert "step_0000004" in message and "step_0000002" in message


def test_a_path_that_is_not_a_checkpoint(tmp_path, caplog):
    assert Checkpointer(tmp_path, CheckpointConfig()).restore(*tiny_run()) is None  # nothing to resume
    saved = Checkpointer(tmp_path, CheckpointConfig()).save(5, *tiny_run(), extra={"wandb_id": "abc"})
    assert read_train_state(saved)["extra"] == {"wandb_id": "abc"}  # what the trainer needs before W&B starts
    (saved / "train_state.json").unlink()
    with pytest.raises(UserError, match=r"^checkpoint.resume=.*cannot resume from it \(train_state.json is missing"):
        Checkpointer(tmp_path, CheckpointConfig()).restore(*tiny_run(), path=saved)
    # a path that is not there (a typo, checkpoint.resume='' read as the working dir's '.') says so
    with pytest.raises(UserError, match=r"^checkpoint.resume='.*step_0000099': cannot resume from it \(no such dir"):
        Checkpointer(tmp_path, CheckpointConfig()).restore(*tiny_run(), path=tmp_path / "step_0000099")
    # each said once, in its error: no warning that it was "skipped" for a checkpoint that nothing follows
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "skipping" in r.getMessage()]


def test_config_changes_are_classified():
    old = {"model": {"dim": 128, "n_layers": 4}, "optimizer": {"lr": 1e-3}, "ac": {"mode": "none"},
           "train": {"seq_len": 64, "steps": 10, "log_every": 1}, "data": {"name": "pydoc", "prefetch": 2}}
    new = json.loads(json.dumps(old))
    new["model"]["n_layers"] = 2
    new["train"]["seq_len"] = 32
    new["optimizer"]["lr"] = 2e-3
    new["train"]["steps"] = 20
    new["ac"]["mode"] = "full"
    new["data"]["prefetch"] = 0
    new["data"]["hf_revision"] = "1b2c3d4"  # another revision of a Hub dataset: other files
    refused, applied, allowed = config_changes(old, new)
    assert refused == ["data.hf_revision: None -> '1b2c3d4'", "model.n_layers: 4 -> 2", "train.seq_len: 64 -> 32"]
    assert applied == ["optimizer.lr: 0.001 -> 0.002", "train.steps: 10 -> 20"]
    assert allowed == ["ac.mode: 'none' -> 'full'", "data.prefetch: 2 -> 0"]


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp_checkpoint_is_sharded_and_resumes_bitwise_under_torchrun(tmp_path):
    proc = run_ranks(2, checkpoint_driver.main, tmp_path, "parallelism=fsdp", cwd=tmp_path)
    assert proc.returncode == 0, proc.why()
    for rank in (0, 1):
        losses = json.loads((tmp_path / f"losses_rank{rank}.json").read_text())
        assert losses["resumed"] == losses["uninterrupted"], rank

    saved = tmp_path / "checkpoints" / "step_0000003"
    files = sorted(p.name for p in saved.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST, "rng_rank0.pt", "rng_rank1.pt",
                     "train_state.json"]
    assert verify(saved) is None  # both ranks' checksums made it into the manifest
    # each rank wrote its own half of every weight: two chunks per tensor, one per rank
    metadata = FileSystemReader(saved).read_metadata().state_dict_metadata
    weight = metadata["model.layers.0.attention.wq.weight"]
    assert [chunk.sizes[0] for chunk in weight.chunks] == [weight.size[0] // 2] * 2
    assert os.path.getsize(saved / "__0_0.distcp") > 0


@pytest.mark.slow
@pytest.mark.dist
def test_a_run_resumes_on_another_world_size_with_the_losses_of_one_uninterrupted_run(tmp_path, caplog):
    """FSDP over two ranks for 3 steps on CPython's docs; the same run dir continued by the two ranks on the docs'
    token file (data=tokens: each rank its own rows, from the checkpoint's token) for 3 more; then resumed as one
    process (a requeue onto a smaller allocation, or a layout changed after an OOM) for 3 more: DCP reshards the
    model and the optimizer states, the data stream goes on where the global batch left it, and the loss curve is
    that of one process that read the docs and never stopped."""
    from membudget.pretokenize import pretokenize

    common = ["logger=none", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
              "data.prefetch=0", "model.n_layers=2", "train.progress=lines"]
    pretokenize(compose_cfg(), tmp_path / "docs.tokens", most_tokens=9 * 4 * 33)
    tokens = ["data=tokens", f"data.path={tmp_path / 'docs.tokens'}"]
    run = tmp_path / "run"
    proc = train_py_ranks(2, tmp_path, f"hydra.run.dir={run}", "parallelism=fsdp", *common, "train.steps=3",
                          "checkpoint.every_steps=3")
    assert proc.returncode == 0, proc.why()
    proc = train_py_ranks(2, tmp_path, f"hydra.run.dir={run}", "parallelism=fsdp", *common, *tokens,
                          "train.steps=6", "checkpoint.every_steps=3")
    assert proc.returncode == 0, proc.why()
    for log in ("train.log", "train_rank1.log"):  # each rank continues at the same token: 3 x 4 x 33
        text = (run / log).read_text()
        assert re.search(r"continuing on the token file .*docs\.tokens from the checkpoint's place in what it read "
                         r"\(epoch 0, \d+ tokens into document \d+\): token 396 of epoch 0", text), (log, text)
    saved = run / "checkpoints" / "step_0000006"
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # sharded by two
    with caplog.at_level(logging.INFO, logger="membudget"):
        resumed = train_here(run, *common, *tokens, "train.steps=9")
    assert f"resumed from {saved} at step 6" in caplog.text
    assert "parallelism.name: 'fsdp' -> 'single'" in caplog.text  # a change that leaves the math alone
    reference = train_here(tmp_path / "one", *common, "train.steps=9")
    assert resumed["world_size"] == 1 and resumed["status"] == "completed"
    rows, expected = read_metrics(run), read_metrics(tmp_path / "one")
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in expected], rel=1e-4)
    assert resumed["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-4)
