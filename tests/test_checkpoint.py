"""Checkpoints: a resumed run reproduces the uninterrupted one bit for bit (also FSDP under torchrun, sharded on
disk), a killed save never costs the last good checkpoint, only the last K are kept, bad paths fail early."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import membudget.checkpoint as checkpoint_module
from membudget.checkpoint import Checkpointer, read_train_state
from membudget.config import CheckpointConfig, UserError
from tests.checkpoint_driver import SMALL, Run
from tests.conftest import FAST_COMPILE, ROOT, compose_cfg


@pytest.mark.parametrize("ac", ["ac=none", "ac=full", "ac=memory_budget"])
def test_resumed_run_matches_uninterrupted_run_bitwise(tmp_path, ac):
    cfg = compose_cfg(*SMALL, ac, FAST_COMPILE)
    checkpointer = Checkpointer(tmp_path, cfg.checkpoint)
    run = Run.build(cfg)
    run.train(3)
    torch.rand(7)  # RNG drawn during training (dropout, sampling) moves it away from the seeded state
    run.save(checkpointer, 3)
    rand_after_save = torch.rand(4)
    uninterrupted = run.train(3)

    resumed = Run.build(cfg)
    step, extra = resumed.load(checkpointer, checkpointer.resume_path())
    assert step == 3 and extra == {"data": {"step": 3, "epoch": 0, "doc": 0, "offset": 0}}
    assert torch.equal(torch.rand(4), rand_after_save)
    assert resumed.train(3) == uninterrupted
    assert resumed.scheduler.get_last_lr() == run.scheduler.get_last_lr()
    for a, b in zip(resumed.model.parameters(), run.model.parameters(), strict=True):
        assert torch.equal(a, b)


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
    assert checkpointer.load(good, *tiny_run()) == (1, {"rows": 1})

    checkpointer.save(3, *tiny_run(), extra={"rows": 3})
    assert sorted(p.name for p in checkpointer.dir.iterdir()) == ["step_0000003"]


def test_keeps_the_last_k_checkpoints_and_resaves_a_step(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=2))
    for step in (1, 2, 3, 4):
        checkpointer.save(step, *tiny_run(), extra={})
    assert [p.name for p in checkpointer.complete()] == ["step_0000003", "step_0000004"]
    # after resuming from step 3, step 4 is written again: the new one replaces the old
    checkpointer.save(4, *tiny_run(), extra={"again": True})
    assert sorted(p.name for p in checkpointer.dir.iterdir()) == ["step_0000003", "step_0000004"]
    assert checkpointer.load(checkpointer.latest(), *tiny_run()) == (4, {"again": True})


def test_due_every_n_steps_and_at_the_last_step(tmp_path):
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(every_steps=4))
    assert [s for s in range(1, 11) if checkpointer.due(s, 10)] == [4, 8, 10]
    assert not Checkpointer(tmp_path, CheckpointConfig(enabled=False)).due(10, 10)


def test_resume_modes_and_a_path_that_is_not_a_checkpoint(tmp_path):
    assert Checkpointer(tmp_path, CheckpointConfig(resume="auto")).resume_path() is None
    saved = Checkpointer(tmp_path, CheckpointConfig()).save(5, *tiny_run(), extra={"wandb_id": "abc"})
    assert read_train_state(saved) == (5, {"wandb_id": "abc"})  # what the trainer needs before W&B starts
    assert Checkpointer(tmp_path, CheckpointConfig(resume="auto")).resume_path() == saved
    assert Checkpointer(tmp_path, CheckpointConfig(resume="never")).resume_path() is None
    assert Checkpointer(tmp_path, CheckpointConfig(resume=str(saved))).resume_path() == saved
    (saved / "train_state.json").unlink()
    with pytest.raises(UserError, match=r"^checkpoint.resume=.*not a complete checkpoint"):
        Checkpointer(tmp_path, CheckpointConfig(resume=str(saved))).resume_path()
    assert Checkpointer(tmp_path, CheckpointConfig(resume="auto")).resume_path() is None


def test_unwritable_checkpoint_dir_fails_early_in_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    checkpointer = Checkpointer(blocker / "run", CheckpointConfig())
    with pytest.raises(UserError) as err:
        checkpointer.check_writable()
    assert str(blocker / "run" / "checkpoints") in str(err.value) and "\n" not in str(err.value)
    Checkpointer(blocker / "run", CheckpointConfig(enabled=False)).check_writable()  # nothing to write


def test_bad_keep_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"^checkpoint.keep=0: must be at least 1"):
        Checkpointer(tmp_path, CheckpointConfig(keep=0))


def test_fsdp_checkpoint_is_sharded_and_resumes_bitwise_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tests.checkpoint_driver", str(tmp_path), "parallelism=fsdp"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        losses = json.loads((tmp_path / f"losses_rank{rank}.json").read_text())
        assert losses["resumed"] == losses["uninterrupted"], rank

    saved = tmp_path / "checkpoints" / "step_0000003"
    files = sorted(p.name for p in saved.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt", "train_state.json"]
    # each rank wrote its own half of every weight: two chunks per tensor, one per rank
    metadata = FileSystemReader(saved).read_metadata().state_dict_metadata
    weight = metadata["model.layers.0.attention.wq.weight"]
    assert [chunk.sizes[0] for chunk in weight.chunks] == [weight.size[0] // 2] * 2
