"""How long a streamed dataset's resume takes: from the stream's saved position (what a checkpoint holds) against
from the first document (a checkpoint without it), alternated, on a local corpus streamed through Hugging Face
datasets as data=c4 or data=fineweb_edu stream from the Hub.

    python scripts/bench_data_resume.py                 # 20 files x 20,000 documents (160 MB), 3 pairs
    python scripts/bench_data_resume.py --files 8 --pairs 5

Prints each pair and the median ratio (saved position / first document) with its range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.data import TokenBatches  # noqa: E402
from membudget.tokenizer import ByteTokenizer  # noqa: E402
from membudget.schema import DataConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--docs", type=int, default=20_000, help="documents per file")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for f in range(args.files):
            with open(Path(folder) / f"part{f:03d}.jsonl", "w") as out:
                for i in range(args.docs):
                    out.write(json.dumps({"text": f"file {f} document {i} " + "x" * 400}) + "\n")
        cfg = DataConfig(name="hf", hf_path="json", hf_data_files=f"{folder}/*.jsonl")

        def batches() -> TokenBatches:
            return TokenBatches(cfg, ByteTokenizer(), global_batch_size=8, seq_len=2047, seed=0)

        reader, target = batches(), (args.files - 1) * args.docs + args.docs // 4  # into the last file
        while reader.state_dict()["doc"] < target:
            next(reader)
        saved = json.loads(json.dumps(reader.state_dict()))
        want = next(reader)[0]
        without = {k: v for k, v in saved.items() if k != "hub"}
        print(f"{args.files} files x {args.docs:,} documents, resumed at document {saved['doc']:,}")
        ratios = []
        for pair in range(args.pairs):
            seconds = []
            for state in (saved, without):
                resumed = batches()
                start = time.perf_counter()
                resumed.load_state_dict(state)
                got = next(resumed)[0]
                seconds.append(time.perf_counter() - start)
                assert bool((got == want).all()), "a resume gave another batch"
            ratios.append(seconds[0] / seconds[1])
            print(f"pair {pair + 1}: saved position {seconds[0]:.2f} s, first document {seconds[1]:.2f} s", flush=True)
        print(f"ratio (saved position / first document): median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs")


if __name__ == "__main__":
    main()
