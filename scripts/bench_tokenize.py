"""How many tokens per second one rank's batches get from the Llama 3 tokenizer, with one tokenizing thread against
several (data.tokenize_threads), alternated. Every rank tokenizes the whole global batch, so a rank must keep up
with the job's tokens/s in all: world size x tokens/s per GPU (128 H100s of Llama 3 8B at 5,605 tokens/s each,
torchtitan's Table 3, need 0.72 M tokens/s on every rank; 512 need 2.9 M).

    python scripts/bench_tokenize.py --bpe /models/tokenizer.model          # Meta's file; any tiktoken BPE works
    python scripts/bench_tokenize.py --bpe FILE --threads 4 --pairs 7

Reads CPython's documentation (present everywhere) cut into documents of 2,200 characters (about 500 tokens, web
text's size), as data=jsonl, in global batches of 32 x 8192 tokens, and prints each pair and the median ratio
(threads / one thread) with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.data import Documents, Llama3Tokenizer, TokenBatches  # noqa: E402
from membudget.schema import DataConfig  # noqa: E402

BATCH, SEQ, DOC_CHARS = 32, 8191, 2200


def corpus(folder: str) -> DataConfig:
    """CPython's documentation cut into DOC_CHARS-character documents, four times over, as a jsonl file."""
    text = "\n".join(Documents(DataConfig()).read())
    with open(Path(folder) / "docs.jsonl", "w") as out:
        for _ in range(4):
            for i in range(0, len(text), DOC_CHARS):
                out.write(json.dumps({"text": text[i:i + DOC_CHARS]}) + "\n")
    return DataConfig(name="jsonl", path=str(Path(folder) / "docs.jsonl"))


def tokens_per_s(cfg: DataConfig, tokenizer, threads: int, batches: int) -> float:
    data = TokenBatches(cfg, tokenizer, global_batch_size=BATCH, seq_len=SEQ, seed=0, threads=threads)
    try:
        next(data)  # the reader opened
        start = time.perf_counter()
        for _ in range(batches):
            next(data)
        return batches * BATCH * (SEQ + 1) / (time.perf_counter() - start)
    finally:
        data.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bpe", required=True, help="a tiktoken BPE file (Meta's Llama 3 tokenizer.model)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    tokenizer = Llama3Tokenizer(args.bpe)
    print(f"{args.batches} batches of {BATCH} x {SEQ + 1} tokens, 1 thread against {args.threads}, "
          f"{len(os.sched_getaffinity(0))} CPUs")
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        cfg = corpus(folder)
        for pair in range(args.pairs):
            one = tokens_per_s(cfg, tokenizer, 1, args.batches)
            many = tokens_per_s(cfg, tokenizer, args.threads, args.batches)
            ratios.append(many / one)
            print(f"pair {pair + 1}: 1 thread {one / 1e6:.2f} M tokens/s, {args.threads} threads "
                  f"{many / 1e6:.2f} M tokens/s, ratio {many / one:.2f}")
    print(f"median ratio {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
