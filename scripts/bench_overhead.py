"""Step-time overhead of membudget's training loop against a bare hand-written PyTorch loop.

Both train the same model (same AC mode, compile and batch) on the same tokens. Each is timed over a short
and a long run and the difference is divided by the extra steps, so set-up, compilation and warm-up cancel
out and only the per-step cost stays: the loop's own work (activation counting, metrics.jsonl, progress)
shows up in the ratio.

    python scripts/bench_overhead.py                        # ac=none
    python scripts/bench_overhead.py ac=memory_budget compile.backend=aot_eager_decomp_partition
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.ac import compiler_scope  # noqa: E402
from membudget.config import register_configs  # noqa: E402
from membudget.data import TokenBatches, build_tokenizer  # noqa: E402
from membudget.trainer import build_model, train  # noqa: E402


def bare_loop(cfg, steps: int) -> float:
    """The loop a user would write by hand: forward, loss, backward, clip, step. Returns seconds."""
    with compiler_scope(cfg.ac):
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
        batches = TokenBatches(cfg.data, build_tokenizer(cfg.tokenizer), cfg.train.global_batch_size,
                               cfg.train.seq_len, cfg.train.seed)
        start = time.perf_counter()
        for _ in range(steps):
            x, y = next(batches)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
        return time.perf_counter() - start


def membudget_loop(cfg, steps: int) -> float:
    cfg.train.steps = steps
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        train(cfg, Path(run_dir))
        return time.perf_counter() - start


def per_step(fn, cfg, short: int, long: int, repeats: int) -> float:
    """Seconds per step from the difference of a long and a short run (best of `repeats`)."""
    return min((fn(cfg.copy(), long) - fn(cfg.copy(), short)) / (long - short) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "train.progress=off", *args.overrides])
    torch.set_num_threads(torch.get_num_threads())
    ours = per_step(membudget_loop, cfg, args.short, args.long, args.repeats)
    bare = per_step(bare_loop, cfg, args.short, args.long, args.repeats)
    print(f"ac={cfg.ac.mode} batch={cfg.train.global_batch_size}x{cfg.train.seq_len} "
          f"threads={torch.get_num_threads()}")
    print(f"membudget loop: {ours * 1e3:.2f} ms/step   bare loop: {bare * 1e3:.2f} ms/step")
    print(f"step-time ratio (membudget / bare): {ours / bare:.3f}   (target <= 1.05)")


if __name__ == "__main__":
    main()
