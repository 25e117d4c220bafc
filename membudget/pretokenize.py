r"""`python -m membudget.pretokenize OUT <overrides>`: tokenize a corpus once into a token file, for data=tokens.

The overrides are train.py's: data= (and data.path, data.hf_*) say the source, tokenizer= (and tokenizer.path) the
tokenizer. A run with data=tokens data.path=OUT and the same tokenizer trains on the batches a run over the source
would, for any data-parallel size, with each rank reading only its own rows of each global batch instead of
reading and tokenizing all of it (every rank, every step):

    python -m membudget.pretokenize /data/c4.tokens data=c4 tokenizer=llama3 tokenizer.path=tokenizer.model \
        --most-tokens 2_000_000_000
    python train.py data=tokens data.path=/data/c4.tokens tokenizer=llama3 tokenizer.path=tokenizer.model

A run already training on the source continues on the file: rerun its command with those two data= overrides (and
its run dir), and it goes on from its last checkpoint's token (membudget.token_file.TokenFile.position_of).

A run reads train.steps x train.global_batch_size x (train.seq_len + 1) tokens (an 8B run of 1,000 steps at
Table 1's 16 x 8192 per step: 131 M); --most-tokens that many or more keeps it within one epoch.

A write that stops (Ctrl-C, SIGTERM from a SLURM time limit, a full disk) keeps what it wrote beside OUT, and the
same command continues from there (membudget.token_file.write).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from hydra.errors import HydraException
from omegaconf import OmegaConf
from tqdm import tqdm

from membudget.data import (
    Documents,
    HubDocuments,
    TokenizedDocuments,
    data_fingerprint,
    read_ahead,
    source_words,
    tokenize_threads,
)
from membudget.errors import UserError
from membudget.launch import compose_config
from membudget.rules import check_data
from membudget.schema import DataName
from membudget.token_file import partial_dir, refuse_existing, write
from membudget.tokenizer import build_tokenizer, tokenizer_words

log = logging.getLogger("membudget")


def pretokenize(cfg, out: Path, most_tokens: Optional[int] = None, threads: Optional[int] = None) -> dict:
    """Write the token file `out` from the documents of cfg.data, tokenized by cfg.tokenizer (up to `most_tokens`,
    whole documents); `threads` tokenize ahead (default: data.tokenize_threads's rule for one process).
    Returns its meta.json."""
    if cfg.data.name in (DataName.synthetic, DataName.tokens):
        raise UserError(f"data.name={cfg.data.name.value!r}: has no documents to tokenize; choose the source with "
                        f"data=text, data=jsonl, data=pydoc or a Hub dataset (data=c4, data=fineweb_edu)")
    refuse_existing(out)
    tokenizer = build_tokenizer(cfg.tokenizer)
    threads = threads or tokenize_threads(cfg.data, cfg.tokenizer, local_ranks=1)
    meta = made_from(cfg, tokenizer)
    log.info("pretokenize: %s through %s into %s (%d tokenizing thread%s)", source_words(cfg.data),
             tokenizer_words(meta["tokenizer"]), out, threads, "" if threads == 1 else "s")
    with tqdm(unit=" tokens", unit_scale=True, total=most_tokens, disable=None, mininterval=1.0) as bar, \
            ThreadPoolExecutor(threads) if threads > 1 else contextlib.nullcontext() as pool:
        source = SourceIds(cfg.data, tokenizer, pool, threads)
        written = write(out, source, meta, tokenizer.vocab_size, most_tokens,
                        progress=lambda documents, tokens: bar.update(tokens - bar.n))
    log.info("pretokenize: %s tokens of %s documents written to %s%s; train on it with data=tokens data.path=%s",
             f"{written['tokens']:,}", f"{written['documents']:,}", out,
             "" if most_tokens is None else f" (the first documents up to {most_tokens:,} tokens)", out)
    return written


def made_from(cfg, tokenizer) -> dict:
    """What a token file is made from, kept in its meta.json: the tokenizer, the source, the source's files."""
    source = {key: value for key, value in OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True).items()
              if key not in ("prefetch", "tokenize_threads")}  # how a run reads, not what
    return {"tokenizer": tokenizer.identity(), "source": source, "source_fingerprint": data_fingerprint(cfg.data)}


class SourceIds:
    """The ids of cfg.data's documents from any document on (token_file.Source), tokenized by `threads`."""

    def __init__(self, data, tokenizer, pool: Optional[ThreadPoolExecutor], threads: int):
        self._documents, self._tokenizer, self._pool, self._threads = Documents(data), tokenizer, pool, threads
        self._docs = None

    def read(self, start: int, resume: Optional[dict]) -> TokenizedDocuments:
        self._docs = self._documents.read(start=start, resume=resume)
        return TokenizedDocuments(self._docs, self._tokenizer, self._pool, read_ahead(self._threads))

    def position(self, doc: int) -> Optional[dict]:
        return self._docs.position(doc) if isinstance(self._docs, HubDocuments) else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m membudget.pretokenize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the token file to write (a directory that must not exist yet)")
    parser.add_argument("overrides", nargs="*",
                        help="train.py's overrides that say the source and the tokenizer: data=jsonl data.path=... "
                             "tokenizer=llama3 tokenizer.path=...")
    parser.add_argument("--most-tokens", type=int, default=None, metavar="N",
                        help="stop after the document that takes the count to N tokens (default: the whole source)")
    parser.add_argument("--threads", type=int, default=None,
                        help="tokenizing threads (default: this process's CPUs, at most 8; 1 for the byte tokenizer)")
    args = parser.parse_args(argv)
    if args.most_tokens is not None and args.most_tokens < 1:
        parser.error(f"--most-tokens={args.most_tokens}: must be a positive number of tokens")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads}: must be a positive number of threads")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stopped_by = []

    def terminate(signum, frame) -> None:
        stopped_by.append("SIGTERM")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        try:
            cfg = compose_config(args.overrides)
        except HydraException as e:
            raise UserError(f"{' '.join(args.overrides)}: {str(e).strip().splitlines()[0]}") from None
        check_data(cfg)
        pretokenize(cfg, args.out.expanduser().absolute(), args.most_tokens, args.threads)
    except UserError as e:
        log.error("error: %s", e)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (a SLURM time limit, scancel): token_file.write said what is kept
        if not partial_dir(args.out.expanduser().absolute()).exists():
            log.warning("pretokenize: stopped before it wrote anything")
        return 143 if stopped_by == ["SIGTERM"] else 130
    finally:
        signal.signal(signal.SIGTERM, previous)  # main() called in a process that goes on (tests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
