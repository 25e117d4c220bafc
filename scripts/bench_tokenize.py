"""How many tokens per second one rank's batches get from the Llama 3 tokenizer, with one tokenizing thread against
several (data.tokenize_threads), alternated. Every rank tokenizes the whole global batch, so a rank must keep up
with the job's tokens/s in all: world size x tokens/s per GPU (128 H100s of Llama 3 8B at 5,605 tokens/s each,
torchtitan's Table 3, need 0.72 M tokens/s on every rank; 512 need 2.9 M).

    python scripts/bench_tokenize.py --bpe /models/tokenizer.model          # Meta's file; any tiktoken BPE works
    python scripts/bench_tokenize.py --bpe FILE --threads 4 --pairs 7
    python scripts/bench_tokenize.py --bpe FILE --token-file --dp 8         # one thread against data=tokens
    python scripts/bench_tokenize.py --bpe FILE --token-file /data/c4.tokens --dp 512   # your storage

--token-file: the same corpus tokenized once (python -m membudget.pretokenize) and read as one rank of --dp
data-parallel ranks reads it (data=tokens: its own rows only), against one tokenizing thread; both as the job's
tokens/s that one rank keeps up with. That file is in the page cache (just written): storage is not measured.
--token-file PATH reads a token file of yours (made with the --bpe file) instead, each pair further into it, so
that a file larger than the page cache is read from its storage as a run would.

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

from omegaconf import OmegaConf  # noqa: E402

from membudget.data import Documents, TokenBatches  # noqa: E402
from membudget.pretokenize import pretokenize  # noqa: E402
from membudget.schema import DataConfig, DataName, TokenizerConfig  # noqa: E402
from membudget.tokenizer import Llama3Tokenizer  # noqa: E402

BATCH, SEQ, DOC_CHARS = 32, 8191, 2200


def corpus(folder: str) -> DataConfig:
    """CPython's documentation cut into DOC_CHARS-character documents, four times over, as a jsonl file."""
    text = "\n".join(Documents(DataConfig()).read())
    with open(Path(folder) / "docs.jsonl", "w") as out:
        for _ in range(4):
            for i in range(0, len(text), DOC_CHARS):
                out.write(json.dumps({"text": text[i:i + DOC_CHARS]}) + "\n")
    return DataConfig(name="jsonl", path=str(Path(folder) / "docs.jsonl"))


def batches_of(cfg: DataConfig, tokenizer, threads: int = 1, dp: int = 1) -> TokenBatches:
    """The last of `dp` ranks' batches, its reader opened."""
    data = TokenBatches(cfg, tokenizer, global_batch_size=BATCH, seq_len=SEQ, seed=0, threads=threads,
                        dp_rank=dp - 1, dp_size=dp)
    next(data)
    return data


def tokens_per_s(data: TokenBatches, batches: int) -> float:
    """The job's tokens/s (global batches) that `data`'s rank gets its next `batches` at."""
    start = time.perf_counter()
    for _ in range(batches):
        next(data)
    return batches * BATCH * (SEQ + 1) / (time.perf_counter() - start)


def fresh_tokens_per_s(cfg: DataConfig, tokenizer, threads: int, batches: int) -> float:
    data = batches_of(cfg, tokenizer, threads)
    try:
        return tokens_per_s(data, batches)
    finally:
        data.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bpe", required=True, help="a tiktoken BPE file (Meta's Llama 3 tokenizer.model)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--token-file", nargs="?", const="", default=None, metavar="PATH",
                        help="one thread against a token file (data=tokens): the corpus's, or PATH")
    parser.add_argument("--dp", type=int, default=8, help="--token-file: the data-parallel ranks (BATCH's divisor)")
    args = parser.parse_args()
    tokenizer = Llama3Tokenizer(args.bpe)
    reading = args.token_file is not None
    other = f"a token file read as rank {args.dp - 1} of {args.dp}" if reading else f"{args.threads} threads"
    print(f"{args.batches} batches of {BATCH} x {SEQ + 1} tokens, 1 thread against {other}, "
          f"{len(os.sched_getaffinity(0))} CPUs")
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        cfg = corpus(folder)
        if args.token_file == "":  # the corpus's own
            bpe = TokenizerConfig(name="tiktoken", path=args.bpe)
            both = OmegaConf.create({"data": OmegaConf.structured(cfg), "tokenizer": OmegaConf.structured(bpe)})
            pretokenize(both, Path(folder) / "docs.tokens", threads=1)
            args.token_file = str(Path(folder) / "docs.tokens")
        if reading:  # one reader for all pairs: each reads further into the file
            file = batches_of(DataConfig(name=DataName.tokens, path=args.token_file), tokenizer, dp=args.dp)
        for pair in range(args.pairs):
            one = fresh_tokens_per_s(cfg, tokenizer, 1, args.batches)
            many = (tokens_per_s(file, args.batches) if reading else
                    fresh_tokens_per_s(cfg, tokenizer, args.threads, args.batches))
            ratios.append(many / one)
            print(f"pair {pair + 1}: 1 thread {one / 1e6:.2f} M tokens/s, {other} "
                  f"{many / 1e6:.2f} M tokens/s, ratio {many / one:.2f}")
    print(f"median ratio {statistics.median(ratios):.3g} (range {min(ratios):.3g}-{max(ratios):.3g})")


if __name__ == "__main__":
    main()
