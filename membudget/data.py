"""Tokenizers, document sources and the packed, resumable, data-parallel token batches.

    build_tokenizer(cfg.tokenizer)            -> a Tokenizer (bytes, or Llama 3's tiktoken BPE)
    iter_documents(cfg.data)                  -> document strings (pydoc, text, jsonl or a Hugging Face dataset)
    TokenBatches(cfg.data, tokenizer, ...)    -> (inputs, labels) for this data-parallel rank, step after step

Documents are tokenized lazily, one at a time, wrapped in BOS/EOS and packed into one endless stream (the
corpus repeats, epoch after epoch); the stream is cut into windows of seq_len + 1 tokens. Every rank reads the
whole stream and keeps its own rows of the global batch, so a global batch is the same whatever the
data-parallel size, and a position in the stream (epoch, document, token offset) is all a resume needs.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator, Sequence
from itertools import chain, islice
from unittest import mock

import numpy as np
import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe

from membudget.config import DataConfig, TokenizerConfig, UserError


# --------------------------------------------------------------------------------------------- tokenizers

class Tokenizer:
    """The interface every tokenizer has: ids in [0, vocab_size), BOS/EOS ids, encode and decode."""

    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return [self.bos_id] * bos + self._encode(text) + [self.eos_id] * eos

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS=256 and EOS=257: no file needed, any text round-trips."""

    vocab_size, bos_id, eos_id = 258, 256, 257

    def _encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Llama 3's pre-tokenizer split and its 256 special tokens, ids right after the BPE ranks (Meta's tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
_LONG_RUN = re.compile(r"\s{25000}|\S{25000}")


class Llama3Tokenizer(Tokenizer):
    """Llama 3's tiktoken BPE from a local tokenizer.model; with Meta's file, vocab_size = 128000 + 256 = 128256."""

    def __init__(self, path: str | None):
        fix = "point tokenizer.path at Meta's Llama 3 tokenizer.model (original/tokenizer.model in the model download)"
        if not path:
            raise UserError(f"tokenizer.path={path!r}: tokenizer=tiktoken needs a file; {fix}")
        try:
            # tiktoken would copy even a local file into a cache keyed by its path, which goes stale if the file
            # changes: an empty cache dir reads the file directly.
            with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):
                ranks = load_tiktoken_bpe(os.path.expanduser(path))
            if not ranks:
                raise ValueError("no tokens")
            specials = {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
            self.model = tiktoken.Encoding(
                name=os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
            )
        except (OSError, ValueError) as e:
            raise UserError(f"tokenizer.path={path!r}: cannot read it as a tiktoken BPE file ({e}); {fix}") from e
        self.vocab_size = self.model.n_vocab
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]

    def _encode(self, text: str) -> list[int]:
        # tiktoken's regex overflows its stack on a very long run of whitespace (or of non-whitespace): like Meta's
        # tokenizer, cut the text after every 25k-character run and encode the pieces one by one.
        # encode_ordinary: "<|eot_id|>" written in a document stays text and never becomes the special id.
        ids, start = [], 0
        for run in _LONG_RUN.finditer(text):
            ids += self.model.encode_ordinary(text[start:run.end()])
            start = run.end()
        return ids + self.model.encode_ordinary(text[start:])

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids))


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.name == "byte":
        return ByteTokenizer()
    if cfg.name == "tiktoken":
        return Llama3Tokenizer(cfg.path)
    raise UserError(f"tokenizer.name={cfg.name!r}: unknown tokenizer; choose tokenizer=byte or tokenizer=llama3")


def vocab_size_check(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """The tokenizer's largest id must index the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError(
            f"model.vocab_size={model_vocab_size!r}: the {type(tokenizer).__name__} needs {tokenizer.vocab_size} ids; "
            f"set model.vocab_size={tokenizer.vocab_size} or more, or pick another tokenizer"
        )


# ---------------------------------------------------------------------------------------------- documents

def iter_documents(cfg: DataConfig, start: int = 0) -> Iterator[str]:
    """The dataset's documents in a fixed order, from the `start`-th on.

    Files, fields and the Hub are checked now; the documents themselves are read lazily.
    text: each .txt file is one document. jsonl: each non-blank line is one document.
    """
    if cfg.name == "pydoc":
        # The English docs that ship inside CPython: ~0.5 MB of text, present offline.
        from pydoc_data.topics import topics

        return (topics[key] for key in sorted(topics)[start:])
    if cfg.name == "text":
        files = _resolve_files(cfg.path, ".txt")
        return (_read_text(f) for f in files[start:])
    if cfg.name == "jsonl":
        docs = islice(_jsonl_documents(_resolve_files(cfg.path, ".jsonl"), cfg.text_field), start, None)
        # read the first document now: bad JSON or no text_field there fails before the run starts
        first = next(docs, None)
        return docs if first is None else chain([first], docs)
    if cfg.name == "hf":
        return _hf_documents(cfg, start)
    raise UserError(f"data.name={cfg.name!r}: has no documents; choose data=pydoc, text, jsonl, c4 or fineweb_edu")


def _resolve_files(path: str | None, suffix: str) -> list[str]:
    """A file, every `suffix` file under a directory, or a glob's matches, sorted; none, or all empty, is an error."""
    fix = f"point data.path at an existing {suffix} file, directory or glob"
    if not path:
        raise UserError(f"data.path={path!r}: this dataset reads local files; {fix}")
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        files = glob.glob(os.path.join(expanded, "**", f"*{suffix}"), recursive=True)
    else:
        files = [expanded] if os.path.isfile(expanded) else glob.glob(expanded, recursive=True)
    files = sorted(f for f in files if os.path.isfile(f))
    if not files:
        raise UserError(f"data.path={path!r}: file not found (no {suffix} file there, nothing matches); {fix}")
    if all(os.path.getsize(f) == 0 for f in files):
        raise UserError(f"data.path={path!r}: no text at all ({len(files)} empty file(s)); {fix} that holds text")
    return files


def _read_text(file: str) -> str:
    with open(file, encoding="utf-8", errors="replace") as f:
        return f.read()


def _jsonl_documents(files: list[str], text_field: str) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"data.path={file!r}: line {line_no} is not valid JSON ({e}); "
                        "fix that line: each line must be one JSON object"
                    ) from None
                yield _text_of(record, text_field, f"line {line_no} of {file}")


def _text_of(record: object, text_field: str, where: str) -> str:
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(
            f"data.text_field={text_field!r}: {where} has no string field {text_field!r} (it has {fields}); "
            "set data.text_field to the field that holds the text"
        )
    return text


def _hf_documents(cfg: DataConfig, start: int) -> Iterator[str]:
    import datasets  # heavy (pyarrow, pandas): only runs that read the Hub pay for it

    if not cfg.hf_path:
        raise UserError(
            f"data.hf_path={cfg.hf_path!r}: data=hf needs a dataset; use data=c4 or data=fineweb_edu, "
            "or data.hf_path=json data.hf_data_files=<local .jsonl>"
        )
    try:
        ds = datasets.load_dataset(
            cfg.hf_path, name=cfg.hf_name, data_files=cfg.hf_data_files, split=cfg.split, streaming=cfg.streaming
        )
    except ConnectionError as e:
        raise UserError(
            f"data.hf_path={cfg.hf_path!r}: cannot reach the Hugging Face Hub ({e}); there is no network here: "
            "set HF_DATASETS_OFFLINE=1 to use a cached copy, or use local files "
            "(data=text, data=jsonl, or data.hf_path=json data.hf_data_files=<file>)"
        ) from None
    except FileNotFoundError as e:
        key, value = ("data.hf_data_files", cfg.hf_data_files) if cfg.hf_data_files else ("data.hf_path", cfg.hf_path)
        raise UserError(f"{key}={value!r}: not found ({e}); point {key} at an existing dataset or file") from None
    where = f"an example of {cfg.hf_path}"
    return (_text_of(example, cfg.text_field, where) for example in ds.skip(start))


# ------------------------------------------------------------------------------------------------ batches

class TokenBatches:
    """Endless (inputs, labels) batches for one data-parallel rank: [global_batch_size // dp_size, seq_len] longs.

    The global batch is global_batch_size consecutive windows of the packed stream, identical for any dp_size;
    rank r keeps rows [r * B, (r + 1) * B). Labels are the inputs shifted by one token. data=synthetic draws
    uniform random ids instead, seeded by (seed, step); `seed` is used for nothing else (the corpus order is fixed).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, global_batch_size: int, seq_len: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch_size % dp_size:
            raise UserError(
                f"train.global_batch_size={global_batch_size!r}: must be divisible by the data-parallel size "
                f"{dp_size}; pick a multiple of {dp_size}"
            )
        self.cfg, self.tokenizer = cfg, tokenizer
        self.global_batch_size, self.seq_len, self.seed = global_batch_size, seq_len, seed
        local = global_batch_size // dp_size
        self.rows = slice(dp_rank * local, (dp_rank + 1) * local)
        self.load_state_dict({"step": 0, "epoch": 0, "doc": 0, "offset": 0})

    def state_dict(self) -> dict:
        """Where the next batch starts: `offset` tokens into document `doc` of epoch `epoch`."""
        return {"step": self.step, "epoch": self.epoch, "doc": self.doc, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.doc, self.offset = state["step"], state["epoch"], state["doc"], state["offset"]
        self._tokens: list[int] | None = None  # tokens of document `doc`, read when first needed
        self._open_reader()

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.name == "synthetic":
            # numpy mixes (seed, step) into one stream; torch's CPU generator would keep only 32 bits of a seed.
            rng = np.random.default_rng((self.seed, self.step))
            shape = (self.global_batch_size, self.seq_len + 1)
            windows = torch.from_numpy(rng.integers(0, self.tokenizer.vocab_size, shape, dtype=np.int64)[self.rows])
        else:
            # Every rank reads the whole global batch so the stream advances alike; it keeps only its rows.
            rows = [self._take(self.seq_len + 1) for _ in range(self.global_batch_size)][self.rows]
            windows = torch.tensor(rows, dtype=torch.long)
        self.step += 1
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _open_reader(self) -> None:
        if self.cfg.name == "synthetic":
            return
        self._docs = iter_documents(self.cfg, start=self.doc)
        # An epoch read from its first document that yields no token means the corpus has no text at all.
        self._from_epoch_start, self._epoch_tokens = self.doc == 0, 0

    def _take(self, n: int) -> list[int]:
        """The next n tokens of the packed stream, crossing document and epoch boundaries."""
        out: list[int] = []
        while len(out) < n:
            if self._tokens is None:
                self._tokens = self._read_document()
            if self.offset == len(self._tokens):
                self.doc, self.offset, self._tokens = self.doc + 1, 0, None
                continue
            chunk = self._tokens[self.offset:self.offset + n - len(out)]
            out += chunk
            self.offset += len(chunk)
        return out

    def _read_document(self) -> list[int]:
        try:
            text = next(self._docs)
        except StopIteration:
            if self._from_epoch_start and self._epoch_tokens == 0:
                hf = self.cfg.name == "hf"
                key, value = ("data.hf_path", self.cfg.hf_path) if hf else ("data.path", self.cfg.path)
                raise UserError(f"{key}={value!r}: the dataset has no text at all; point {key} at data with text")
            self.epoch, self.doc = self.epoch + 1, 0
            self._open_reader()
            return self._read_document()
        tokens = self.tokenizer.encode(text) if text else []  # empty documents add nothing, not even BOS/EOS
        self._epoch_tokens += len(tokens)
        return tokens
