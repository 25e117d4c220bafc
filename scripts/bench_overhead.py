"""Step-time overhead of membudget's training loop against a bare hand-written PyTorch loop.

Both train the same model (same AC mode, compile and batch) on the same tokens. A measurement of one loop is
its per-step cost: the time of a long run minus a short one, over the extra steps, so set-up, compilation
and warm-up cancel out and only the per-step cost stays (the loop's own work: activation counting, the
non-finite guard's sync, metrics.jsonl, the console). The two loops are measured alternately, A B A B ...,
so a machine that gets slower or faster affects both alike; the ratio of each pair is one sample, and the
median of the samples and their spread are printed.

    python scripts/bench_overhead.py                        # ac=none, 7 pairs
    python scripts/bench_overhead.py ac=memory_budget compile.backend=aot_eager_decomp_partition --pairs 9
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.ac import compiler_scope  # noqa: E402
from membudget.data import TokenBatches  # noqa: E402
from membudget.tokenizer import build_tokenizer  # noqa: E402
from membudget.launch import compose_config  # noqa: E402
from membudget.step import build_model  # noqa: E402
from membudget.trainer import train  # noqa: E402


def bare_loop(cfg, steps: int) -> float:
    """The loop a user would write by hand: forward, loss, backward, clip, step. Returns seconds."""
    with compiler_scope(cfg.ac, n_layers=cfg.model.n_layers):
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
    cfg = cfg.copy()
    cfg.train.steps = steps
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        train(cfg, Path(run_dir))
        return time.perf_counter() - start


def per_step(fn, cfg, short: int, long: int) -> float:
    return (fn(cfg, long) - fn(cfg, short)) / (long - short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    cfg = compose_config(["logger=none", "train.progress=off", "checkpoint.enabled=false", *args.overrides])
    print(f"ac={cfg.ac.mode} batch={cfg.train.global_batch_size}x{cfg.train.seq_len} "
          f"threads={torch.get_num_threads()}, {args.pairs} pairs of ({args.long} - {args.short}) steps")
    ratios, ours, bare = [], [], []
    for i in range(args.pairs):
        ours.append(per_step(membudget_loop, cfg, args.short, args.long))
        bare.append(per_step(bare_loop, cfg, args.short, args.long))
        ratios.append(ours[-1] / bare[-1])
        print(f"pair {i + 1}: membudget {ours[-1] * 1e3:.2f} ms/step, bare {bare[-1] * 1e3:.2f} ms/step, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    print(f"membudget loop: median {statistics.median(ours) * 1e3:.2f} ms/step; bare loop: median "
          f"{statistics.median(bare) * 1e3:.2f} ms/step")
    print(f"step-time ratio (membudget / bare): median {statistics.median(ratios):.3f}, quartiles "
          f"{q[0]:.3f}-{q[2]:.3f}, range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs "
          "(target: median <= 1.05)")


if __name__ == "__main__":
    main()
