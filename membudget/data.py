"""Document sources and the packed, resumable, data-parallel token batches (the tokenizers: membudget.tokenizer).

    Documents(cfg.data).read()                -> document strings (pydoc, text, jsonl or a Hugging Face dataset)
    TokenBatches(cfg.data, tokenizer, ...)    -> (inputs, labels) for this data-parallel rank, step after step
    Prefetcher(batches, depth)                -> the same batches, prepared ahead in a background thread
    data_fingerprint(cfg.data, cfg.tokenizer) -> what the run reads, to compare with a checkpoint's or a rank's

Documents are tokenized lazily, one at a time, wrapped in BOS/EOS and packed into one endless stream (the
corpus repeats, epoch after epoch); the stream is cut into windows of seq_len + 1 tokens. Every rank reads the
whole stream and keeps its own rows of the global batch, so a global batch is the same whatever the
data-parallel size, and a position in the stream (epoch, document, token offset) is all a resume needs. A token
file (data=tokens, membudget.token_file) is that stream written once: each rank reads only its rows of it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np
import torch

from membudget.errors import UserError
from membudget.internals import no_datasets_download_counts
from membudget.options import choices, option_for, options_setting
from membudget.rules import check_global_batch
from membudget.schema import DataConfig, DataName, TokenizerConfig, TokenizerName
from membudget.token_file import COMMAND as PRETOKENIZE
from membudget.token_file import META, TOKENS, TokenFile
from membudget.tokenizer import Tokenizer, digest, file_fingerprint, tokenizer_words

log = logging.getLogger("membudget")


# ---------------------------------------------------------------------------------------------- documents

class Documents:
    """A dataset's documents in a fixed order, opened once: local files are listed and a Hugging Face dataset is
    loaded (and its text field checked) when it is built; `read` gives them from any document on, as often as the
    batches need (the trainer's check of the first batch, a resume, each epoch). Each rank of a job loads its Hub
    dataset once, not at every reread: every load_dataset is requests to the Hub, which answers a job's ranks
    loading at once with HTTP 429 (torchtitan issue #2239, datasets issue #7506).

    The documents themselves are streamed in batches through Hugging Face datasets (local files through its text
    builder): nothing is cached to disk, any size works. text: each .txt file is one document. jsonl: each non-blank
    line is one JSON object, its text_field one document.
    """

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        if cfg.name == DataName.pydoc:
            # The English docs that ship inside CPython: ~0.5 MB of text, present offline.
            from pydoc_data.topics import topics

            self._topics = [topics[key] for key in sorted(topics)]
        elif cfg.name == DataName.text:
            self._files = _resolve_files(cfg.path, ".txt")
        elif cfg.name == DataName.jsonl:
            self._files = _resolve_files(cfg.path, ".jsonl")
        elif cfg.name == DataName.hf:
            self._ds = _load_hf(cfg)
        else:
            raise UserError(f"data.name={cfg.name!r}: has no documents; choose one of {choices('data')}")

    def read(self, start: int = 0, resume: Optional[dict] = None) -> Iterator[str]:
        """The documents from the `start`-th on; `resume`: a streamed Hugging Face dataset's position near it
        (HubDocuments.position), read from there instead of from its first document."""
        cfg = self.cfg
        if cfg.name == DataName.pydoc:
            return iter(self._topics[start:])
        if cfg.name == DataName.text:
            # one document per file: a resume starts at its file, without reading the files before it
            return _text_documents(cfg, self._files[start:])
        if cfg.name == DataName.jsonl:
            # Lines through the text builder, JSON parsed here: the json builder casts every 10 MB chunk to the
            # columns of the first one, so a record with one more field anywhere later (a new key in a metadata
            # dict) fails the whole corpus (datasets issue #6162). Only text_field matters here.
            return _read_first_now(_jsonl_documents(cfg, self._files, start))
        return HubDocuments(self._ds, cfg, start, resume)


def _resolve_files(path: Optional[str], suffix: str) -> list[str]:
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


_READABLE = "keep the files in place and readable while the run reads them"


def _datasets():
    """Hugging Face datasets, imported on first use: ~2 s of imports (pyarrow, pandas) that data=pydoc and
    data=synthetic never pay."""
    import datasets

    no_datasets_download_counts()  # else each load_dataset sends a request to the Hub first, even for local files
    return datasets


def _text_builder_rows(files: list[str], **config) -> Iterator[str]:
    """The rows of datasets' text builder over exactly these files, in this order, streamed (a line each, or
    a whole file with sample_by="document"); bytes that are not UTF-8 become U+FFFD."""
    # escaped: datasets reads each entry as a glob, and a "[" in a file name would silently match nothing
    ds = _datasets().load_dataset("text", data_files=[glob.escape(f) for f in files], split="train", streaming=True,
                               encoding_errors="replace", **config)
    for batch in ds.with_format("arrow").iter(batch_size=1024):  # Arrow batches: ~1.3x faster than Python rows
        yield from batch.column("text").to_pylist()


# How much of each data file is looked at before it is read as text, and the share of it that may be bytes
# that are not UTF-8 text (invalid UTF-8, control characters other than whitespace) before the file is refused
# as binary: a few stray bytes (a Latin-1 letter, a form feed) are warned about, a binary file is refused.
TEXT_PROBE_BYTES = 64 * 1024
MAX_NON_TEXT = 0.10
_TEXT_CONTROLS = frozenset("\t\n\r\f\v\x1b")
_warned_files: set[str] = set()


def check_text_file(path: str, key: str = "data.path") -> None:
    """Refuse a file whose first block is not text, in one line naming it: NUL bytes (a binary file, or
    UTF-16), or more than MAX_NON_TEXT of bytes that are not UTF-8 text; warn once per file when a few are
    (each becomes U+FFFD, or stays a control character, in what is trained on)."""
    import codecs
    import logging

    with open(path, "rb") as f:
        block = f.read(TEXT_PROBE_BYTES)
    if not block:
        return
    fix = f"point {key} at UTF-8 text files (convert it, e.g. `iconv -t UTF-8`, or leave it out)"
    if b"\0" in block:
        raise UserError(f"{key}={path!r}: not a text file (NUL bytes in its first {len(block):,} bytes: binary, "
                        f"or UTF-16 text); {fix}")
    # a UTF-8 character cut at the block's end is not an error: an incremental decode, not final
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(block, final=False)
    bad = text.count("\ufffd") + sum(1 for c in text if c < " " and c not in _TEXT_CONTROLS or c == "\x7f")
    share = bad / max(len(text), 1)
    if share > MAX_NON_TEXT:
        raise UserError(f"{key}={path!r}: not a text file ({share:.0%} of its first {len(block):,} bytes are not "
                        f"UTF-8 text); {fix}")
    if bad and path not in _warned_files:
        _warned_files.add(path)
        logging.getLogger("membudget").warning(
            "%s=%r: %d of the first %s characters (%.2f%%) are not UTF-8 text: invalid bytes are read as U+FFFD; "
            "convert the file to UTF-8 if that is not intended", key, path, bad, f"{len(text):,}", 100 * share)


def _checked(files: list[str], key: str) -> list[str]:
    for file in files:
        check_text_file(file, key)
    return files


def _text_documents(cfg: DataConfig, files: list[str]) -> Iterator[str]:
    if not files:  # a resume at the end of an epoch
        return
    try:
        # one document per file, in order: each file is checked as text just before its document is read
        rows = _text_builder_rows(files, sample_by="document")
        for file in files:
            check_text_file(file)
            yield next(rows)
    except OSError as e:  # a file removed or unreadable since it was listed
        raise UserError(f"data.path={cfg.path!r}: cannot read it ({e}); {_READABLE}") from None


def _jsonl_documents(cfg: DataConfig, files: list[str], start: int) -> Iterator[str]:
    records = 0
    try:
        _checked(files, "data.path")  # a binary file is named as such, not as its first line's bad JSON
        for line_index, line in enumerate(_text_builder_rows(files, encoding="utf-8-sig")):  # -sig: skip a BOM
            if not line.strip():
                continue
            records += 1
            if records <= start:  # a resume skips the records before it without parsing them
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"data.path={cfg.path!r}: {_where(files, line_index)} is not valid JSON ({e}); "
                                "fix that line: each line must be one JSON object") from None
            text = record.get(cfg.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise _field_error(cfg.text_field, _where(files, line_index), record)
            yield text
    except OSError as e:
        raise UserError(f"data.path={cfg.path!r}: cannot read it ({e}); {_READABLE}") from None


def _where(files: list[str], line_index: int) -> str:
    """"line 3 of a.jsonl" for the line_index-th line (from 0) of the files read one after another; counted
    only for an error message, with the same newlines as the text builder."""
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            for line_no, _ in enumerate(f, 1):
                if line_index == 0:
                    return f"line {line_no} of {file}"
                line_index -= 1
    raise AssertionError("the line is in one of the files")


def _field_error(text_field: str, where: str, record: object) -> UserError:
    if isinstance(record, dict) and text_field in record:
        what = f"has {text_field!r} of type {type(record[text_field]).__name__}, not a string"
    elif isinstance(record, dict):
        what = f"has no field {text_field!r} (it has {sorted(record)})"
    else:
        what = f"is a JSON {type(record).__name__}, not an object with a field {text_field!r}"
    return UserError(f"data.text_field={text_field!r}: {where} {what}; set data.text_field to the field that "
                     "holds the text")


def _read_first_now(docs: Iterator[str]) -> Iterator[str]:
    """Read the first document now: bad JSON or no text_field there fails before the run starts."""
    first = next(docs, None)
    return docs if first is None else chain([first], docs)


def _load_hf(cfg: DataConfig):
    """The Hugging Face dataset data.hf_* name (streamed, or downloaded first: data.streaming), its text field
    checked, as a stream."""
    datasets = _datasets()
    hub_options = " or ".join(f"data={o}" for o in options_setting("data", "name", DataName.hf))
    if not cfg.hf_path:
        raise UserError(
            f"data.hf_path={cfg.hf_path!r}: data.name=hf reads a Hugging Face dataset and needs its name; "
            f"use {hub_options}, or data.hf_path=json data.hf_data_files=<local .jsonl>"
        )
    try:
        ds = datasets.load_dataset(cfg.hf_path, name=cfg.hf_name, data_files=cfg.hf_data_files, split=cfg.split,
                                   streaming=cfg.streaming, revision=cfg.hf_revision)
    except Exception as e:
        key, value = ("data.hf_data_files", cfg.hf_data_files) if cfg.hf_data_files else ("data.hf_path", cfg.hf_path)
        status = _http_status(e)
        if status is not None and status != 404:  # datasets words any answer of the Hub but 404 as "not found"
            raise UserError(f"{key}={value!r}: the Hub answered HTTP {status}; {_HUB_FIXES.get(status, _HUB_LATER)}"
                            ) from None
        if isinstance(e, ConnectionError):
            local = ", ".join(option_for("data", "name", name) for name in (DataName.text, DataName.jsonl))
            raise UserError(
                f"data.hf_path={cfg.hf_path!r}: cannot reach the Hugging Face Hub ({e}); there is no network here: "
                f"set HF_DATASETS_OFFLINE=1 to use a cached copy, or use local files "
                f"({local}, or data.hf_path=json data.hf_data_files=<file>)"
            ) from None
        if isinstance(e, FileNotFoundError):
            raise UserError(f"{key}={value!r}: not found ({e}); point {key} at an existing dataset or file") from None
        raise
    if ds.features is not None and cfg.text_field not in ds.features:
        raise _field_error(cfg.text_field, f"the examples of {cfg.hf_path}", dict.fromkeys(ds.features))
    # data.streaming=false: the downloaded dataset read as a stream of its tables, by the one reader (HubDocuments)
    return ds if isinstance(ds, datasets.IterableDataset) else ds.to_iterable_dataset()


# What to do about a Hub that answers with an error (huggingface_hub has retried it already)
_HUB_LATER = "retry later, or read a copy on shared storage (data.hf_path=json or parquet, data.hf_data_files=...)"
_HUB_GATED = "the dataset is gated or private: accept its terms on the Hub and set HF_TOKEN to a token with access"
_HUB_FIXES = {
    401: _HUB_GATED,
    403: _HUB_GATED,
    429: "too many requests (each rank of a job loads the dataset): download it once to shared storage and read it "
         "there (data.hf_path=json or parquet, data.hf_data_files=...), or set HF_TOKEN for a larger quota",
}


def _http_status(error: BaseException) -> Optional[int]:
    """The HTTP status of the Hub's answer behind an error that datasets raised in its own words, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        status = getattr(getattr(error, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
        error = error.__cause__ or error.__context__
    return None


# Documents formatted as Python (decoded as the dataset's features say) in batches: ~3x faster than one by one
HF_BATCH = 256
# Documents each tokenizing thread is given at a time (TokenBatches), enough to keep it busy between hand-offs;
# READ_AHEAD_MOST in all, for HubDocuments to keep the stream's position of each one the batches have not reached
READ_AHEAD, READ_AHEAD_MOST = 16, 128
_MARKS = READ_AHEAD_MOST + 2  # HubDocuments' batch boundaries kept: one per batch of at least one document


def _checked_texts(texts: list, cfg: DataConfig, first: int) -> list:
    for n, text in enumerate(texts, first):
        if not isinstance(text, str):
            raise _field_error(cfg.text_field, f"example {n} of {cfg.hf_path}", {cfg.text_field: text})
    return texts


class HubDocuments:
    """A Hugging Face dataset's documents (streamed, or downloaded and read as a stream) from the `start`-th, which
    also says where each one lies in the stream's own resumable position (`IterableDataset.state_dict`): a resumed
    run continues there, where `skip` streamed every document before it again (for C4 or FineWeb far into a run,
    every shard before it downloaded again before the first step). datasets restarts a position by reading its
    shard from the start, and the shard before when the position lies in its shard's first table. The first
    document is read at once: a bad first record fails before the run starts."""

    def __init__(self, ds, cfg: DataConfig, start: int, resume: Optional[dict]):
        self.cfg, self._ds = cfg, ds
        self._pending: list[str] = []
        if resume is not None and resume.get("doc", start + 1) <= start:
            try:
                self._open(resume["doc"], resume["state"])
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - a position this datasets version cannot take: from the start
                log.warning("data: could not resume the stream at its saved position (%s: %s); reading it from its "
                            "first document to document %d", type(e).__name__, e, start)
                self._open(0, None)
        else:
            self._open(0, None)
        try:
            while self._next < start:  # to `start`: inside its shard (a resume), or from the first document
                self._read()
            self._pending.append(self._read())
        except StopIteration:
            pass  # a stream that ends there: TokenBatches starts the next epoch, or says it has no text

    def __iter__(self) -> "HubDocuments":
        return self

    def __next__(self) -> str:
        return self._pending.pop() if self._pending else self._read()

    def _open(self, doc: int, state: Optional[dict]) -> None:
        """The stream from document `doc`, at the stream position `state` (None: its first document), with its
        first batch read: a position it cannot take fails here."""
        self._stream = self._ds.select_columns([self.cfg.text_field]).with_format("python")
        if state is not None:
            self._stream.load_state_dict(state)
        self._next = doc  # the index of the next document the stream gives
        # (the index of the first document after a batch boundary, the stream's position there) of the last
        # batches read: enough for any document the batches have not passed yet (READ_AHEAD_MOST behind at most)
        self._marks: deque = deque([(doc, state)], maxlen=_MARKS)
        self._batches = self._stream.iter(batch_size=HF_BATCH)
        self._texts: Iterator[str] = iter(())
        self._more()

    def _more(self) -> bool:
        """The stream's next batch into `_texts`; False at its end."""
        try:
            batch = next(self._batches)[self.cfg.text_field]
        except StopIteration:
            return False
        # the stream's position now follows this batch (datasets updates it before handing the batch out)
        first = self._marks[-1][0]
        self._marks.append((first + len(batch), self._stream.state_dict()))
        self._texts = iter(_checked_texts(batch, self.cfg, first))
        return True

    def _read(self) -> str:
        text = next(self._texts, None)
        while text is None:
            if not self._more():
                raise StopIteration
            text = next(self._texts, None)
        self._next += 1
        return text

    def position(self, doc: int) -> dict:
        """Where document `doc` (one of the last READ_AHEAD_MOST this reader gave, or the one after them) lies: a
        stream position at or before it, and that position's document index; Documents.read(start=doc,
        resume=this) continues there."""
        at, state = next(mark for mark in reversed(self._marks) if mark[0] <= doc)
        return {"doc": at, "state": state}


# -------------------------------------------------------------------------------------------- fingerprint

# A fingerprint reads every file's size and samples of the content of a bounded number of files, so that it costs
# a second or less at the start of a run over any corpus (a resume reads its own files, a rank its node's copy).
FINGERPRINT_FILES = 64  # files whose content is sampled (evenly spread over the sorted list); the rest by size
FINGERPRINT_CHUNKS = 16  # chunks of FINGERPRINT_CHUNK bytes, evenly spread over a larger file; a smaller is read whole
FINGERPRINT_CHUNK = 64 * 1024


def data_fingerprint(cfg: DataConfig, tokenizer: Optional[TokenizerConfig] = None) -> dict:
    """What the run's tokens are made of, comparable across machines: the documents (`_documents`) and the
    tokenizer file's name, size and digest, read whole (tiktoken's; the byte tokenizer has no file). A resume or a
    rank that reads other documents than its checkpoint or rank 0 would continue from a position in other text;
    one with another BPE file would cut the same text into other tokens."""
    documents = _documents(cfg)
    if tokenizer is None or tokenizer.name != TokenizerName.tiktoken or tokenizer.path is None:
        return documents
    return {**documents, "tokenizer": file_fingerprint(tokenizer.path)}


def _documents(cfg: DataConfig) -> dict:
    """For data=text and jsonl (and data=hf with local data files) each file's name relative to their common
    directory, its size and a digest of its content (whole up to 1 MiB, else sampled; see the constants above);
    for pydoc a digest of CPython's docs; for a token file its two files; nothing for synthetic data and the Hub (a
    dataset's name is in the config)."""
    if cfg.name == DataName.pydoc:
        from pydoc_data.topics import topics

        return {"pydoc": digest("\0".join(f"{key}\0{topics[key]}" for key in sorted(topics)).encode())}
    if cfg.name in (DataName.text, DataName.jsonl):
        files = _resolve_files(cfg.path, ".txt" if cfg.name == DataName.text else ".jsonl")
    elif cfg.name == DataName.tokens and cfg.path:  # TokenFile says what is wrong with one that is not whole
        root = os.path.expanduser(cfg.path)
        files = [f for f in (os.path.join(root, META), os.path.join(root, TOKENS)) if os.path.isfile(f)]
    elif cfg.name == DataName.hf and cfg.hf_data_files:
        files = sorted(f for f in glob.glob(os.path.expanduser(cfg.hf_data_files), recursive=True) if os.path.isfile(f))
    else:
        return {}
    if not files:
        return {}
    root = os.path.dirname(files[0]) if len(files) == 1 else os.path.commonpath(files)
    sampled = set(np.linspace(0, len(files) - 1, min(len(files), FINGERPRINT_FILES)).round().astype(int).tolist())
    return {"files": {os.path.relpath(f, root): [os.path.getsize(f), _content_digest(f) if i in sampled else None]
                      for i, f in enumerate(files)}}


def _content_digest(path: str) -> str:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= FINGERPRINT_CHUNKS * FINGERPRINT_CHUNK:
            return digest(f.read())
        chunks = []
        for offset in np.linspace(0, size - FINGERPRINT_CHUNK, FINGERPRINT_CHUNKS).astype(np.int64).tolist():
            f.seek(offset)
            chunks.append(f.read(FINGERPRINT_CHUNK))
    return digest(b"".join(chunks))


def unpinned_hub_data(cfg: DataConfig) -> Optional[str]:
    """A line for a run that reads a Hub dataset at no fixed revision, whose files its resume (or a node started
    later) may find changed: the fingerprint has no files of it to compare."""
    if cfg.name != DataName.hf or cfg.hf_data_files or cfg.hf_revision or not cfg.hf_path:
        return None
    return (f"data.hf_revision=None: data.hf_path={cfg.hf_path} is read at its main branch, which may change before "
            f"a resume or between nodes; set data.hf_revision=<commit> (the dataset's commit history on the Hub) to "
            f"read the same files each time")


def data_changes(before: dict, after: dict, then: str = "then", now: str = "now", most: int = 3) -> list[str]:
    """How the tokens of fingerprint `after` differ from `before`'s: the tokenizer file, then the documents file
    by file (the first `most`, and how many more), in words: `then` and `now` name the two sides ("on rank 0",
    "on rank 1"). A fingerprint without a tokenizer (a checkpoint from before they were kept) is not compared on
    it."""
    tokenizer = _tokenizer_change(before.get("tokenizer"), after.get("tokenizer"), then, now)
    return tokenizer + _document_changes({k: v for k, v in before.items() if k != "tokenizer"},
                                         {k: v for k, v in after.items() if k != "tokenizer"}, then, now, most)


def _tokenizer_change(old: Optional[list], new: Optional[list], then: str, now: str) -> list[str]:
    if old is None or new is None or old[1:] == new[1:]:  # by size and content: a copy of it elsewhere is equal
        return []
    (old_name, old_size, _), (name, size, _) = old, new
    if None in (old_size, size):
        return [f"the tokenizer file {name if size is None else old_name} is missing {now if size is None else then}"]
    if old_size != size:
        return [f"the tokenizer file {old_name} is {old_size:,} bytes {then} and {name} {size:,} {now}"]
    return [f"the tokenizer file {name} has other content (the same {size:,} bytes)"]


def _document_changes(before: dict, after: dict, then: str, now: str, most: int) -> list[str]:
    if before == after:
        return []
    if "files" not in before or "files" not in after:
        if "pydoc" in before and "pydoc" in after:
            return [f"CPython's pydoc topics differ (another Python version {now} than {then}?)"]
        return [f"other documents ({_kind(before)} {then}, {_kind(after)} {now})"]
    old, new = before["files"], after["files"]
    changes = []
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            changes.append(f"{name} only {then}")
        elif name not in old:
            changes.append(f"{name} only {now}")
        elif old[name][0] != new[name][0]:
            changes.append(f"{name} is {old[name][0]:,} bytes {then} and {new[name][0]:,} {now}")
        elif None not in (old[name][1], new[name][1]) and old[name][1] != new[name][1]:
            changes.append(f"{name} has other content (the same {new[name][0]:,} bytes)")
    if not changes:  # unreachable while the files sampled follow from their count alone
        changes.append("the files' sampled content differs")
    more = [f"and {len(changes) - most} more files"] if len(changes) > most else []
    return changes[:most] + more


def _kind(fingerprint: dict) -> str:
    if "files" in fingerprint:
        return f"{len(fingerprint['files'])} files"
    return "pydoc" if "pydoc" in fingerprint else "no files"


# ------------------------------------------------------------------------------------------------ batches

# The most threads data.tokenize_threads=null gives a rank: more than a node's share of the CPUs seldom helps
TOKENIZE_THREADS_MOST = 8


def tokenize_threads(cfg: DataConfig, tokenizer: TokenizerConfig, local_ranks: int) -> int:
    """data.tokenize_threads, or what null means: 1 for the byte tokenizer (and for synthetic data and a token
    file, which need no tokenizing), else this process's CPUs shared among its node's `local_ranks`, at most
    TOKENIZE_THREADS_MOST."""
    if cfg.tokenize_threads is not None:
        return cfg.tokenize_threads
    if tokenizer.name == TokenizerName.byte or cfg.name in (DataName.synthetic, DataName.tokens):
        return 1
    # the CPUs this process may run on (SLURM's binding, taskset), where the OS says (Linux); else the machine's
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(TOKENIZE_THREADS_MOST, cpus // max(local_ranks, 1)))


def read_ahead(threads: int) -> int:
    """Documents read ahead of the one being packed by `threads` tokenizing threads (one: none ahead)."""
    return min(READ_AHEAD * threads, READ_AHEAD_MOST) if threads > 1 else 1


class TokenizedDocuments:
    """The ids of `docs` (BOS, the text's, EOS, as int64), in order; an empty document gives none, not even BOS/EOS.
    With a `pool` of threads, up to `ahead` documents are read and handed to it ahead of the one asked for
    (tiktoken releases the GIL); without one, each is tokenized when asked for. A document that cannot be read
    ends the reading, and its error is raised when its turn comes (the first document's: at once)."""

    def __init__(self, docs: Iterator[str], tokenizer: Tokenizer, pool: Optional[ThreadPoolExecutor] = None,
                 ahead: int = 1):
        self._docs, self._tokenizer, self._pool, self._most = docs, tokenizer, pool, ahead
        self._ahead: deque = deque()
        self._read_all = False

    def __iter__(self) -> TokenizedDocuments:
        return self

    def __next__(self) -> np.ndarray:
        self._read_ahead()
        if not self._ahead:
            raise StopIteration
        item = self._ahead.popleft()
        if isinstance(item, BaseException):  # the document that could not be read: its turn came
            raise item
        return item.result() if isinstance(item, Future) else item

    def _read_ahead(self) -> None:
        while len(self._ahead) < self._most and not self._read_all:
            try:
                text = next(self._docs)
            except StopIteration:
                self._read_all = True
                break
            except Exception as e:
                if not self._ahead:
                    raise
                self._ahead.append(e)
                self._read_all = True
                break
            self._ahead.append(self._tokens_of(text) if self._pool is None else
                               self._pool.submit(self._tokens_of, text))

    def _tokens_of(self, text: str) -> np.ndarray:
        return self._tokenizer.encode_array(text) if text else np.empty(0, dtype=np.int64)


def open_token_file(cfg: DataConfig, tokenizer: Tokenizer) -> TokenFile:
    """data=tokens: the token file at data.path, made by this run's tokenizer (its name, vocabulary and file, by
    size and content), else a line that names both and the fix."""
    file = TokenFile(cfg.path)
    made_by, this = file.meta.get("tokenizer") or {}, tokenizer.identity()

    def key(identity: dict) -> tuple:
        return identity.get("name"), identity.get("vocab_size"), (identity.get("file") or [None])[1:]

    if key(made_by) != key(this):
        raise UserError(f"data.path={cfg.path!r}: its tokens were made by {tokenizer_words(made_by)}, this run's "
                        f"tokenizer is {tokenizer_words(this)}; set tokenizer= (and tokenizer.path) to the one it "
                        f"was made with, or tokenize the source again with this one: {PRETOKENIZE}")
    return file


def source_words(cfg: DataConfig) -> str:
    """What a run reads, in words: `data=jsonl data.path=...`, `data.hf_path=... (name)`, `data=pydoc`."""
    name = DataName(cfg.name)  # a DataConfig built in code may hold the name as a string
    if cfg.hf_path and name == DataName.hf:
        return f"data.hf_path={cfg.hf_path}" + (f" ({cfg.hf_name})" if cfg.hf_name else "")
    return f"data={name.value}" + (f" data.path={cfg.path}" if cfg.path else "")


@dataclass
class TokenFileSwitch:
    """How a run goes on on this run's token file (`file`) from a checkpoint that read its source, or another token
    file of the same source (`earlier`: a file of its first documents, say): the same batches from the checkpoint's
    token on. `compared`: what the checkpoint's data fingerprint must equal (the source's, or the earlier file's)."""

    file: TokenFile
    compared: dict
    earlier: Optional[TokenFile] = None

    def position(self, state: dict) -> dict:
        """The checkpoint's data position (TokenBatches' state) as a position in `file`."""
        return self.file.position_of(state, self.earlier)


def switch_to_token_file(saved: Optional[dict], saved_fingerprint: Optional[dict], cfg: DataConfig,
                         fingerprint: dict) -> Optional[TokenFileSwitch]:
    """A TokenFileSwitch where this run reads a token file and a checkpoint (`saved`: its config's data section,
    `saved_fingerprint`: its data fingerprint) read the file's source, or another token file of that source, or
    this one at another path (moved or copied); `fingerprint`: this run's data fingerprint. One line when the file
    was made from another source (the settings that say what is read; the files are compared through `compared`).
    None when this run reads no token file, or the checkpoint read the same one at the same path."""
    if cfg.name != DataName.tokens or not saved or saved.get("name") == DataName.synthetic.value:
        return None
    if saved.get("name") == DataName.tokens.value:
        if saved.get("path") == cfg.path:
            return None
        same = "files" in fingerprint and (saved_fingerprint or {}).get("files") == fingerprint["files"]
        if same:  # the same file elsewhere (by its files' names, sizes and content): the same stream
            file = TokenFile(cfg.path)
            return TokenFileSwitch(file, fingerprint, earlier=file)
        try:
            earlier = TokenFile(saved.get("path"))
        except UserError as e:
            raise UserError(f"data.path={cfg.path!r}: the checkpoint read the token file {saved.get('path')}, which "
                            f"says where the run stands in their source, and it cannot be read now ({e})") from None
        source, where = earlier.meta.get("source") or {}, f"the token file {saved.get('path')}"
    else:
        earlier, source, where = None, saved, "the checkpoint's"
    file = TokenFile(cfg.path)
    ours = file.meta.get("source") or {}
    differ = [f"data.{key}={source.get(key)!r} there, {value!r} in its meta.json" for key, value in sorted(ours.items())
              if key != "path" and source.get(key) != value]  # the path may differ: the files' fingerprints decide
    if earlier is not None and earlier.meta.get("source_fingerprint") != file.meta.get("source_fingerprint"):
        differ.append("other documents")
    if differ:
        raise UserError(f"data.path={cfg.path!r}: made from another source than {where} ({'; '.join(differ)}); "
                        f"continue on that, or tokenize its source: {PRETOKENIZE}")
    tokenizer = {k: v for k, v in fingerprint.items() if k == "tokenizer"}  # this run's, as the checkpoint's was
    read = (file.meta["source_fingerprint"] if earlier is None
            else _documents(DataConfig(name=DataName.tokens, path=saved.get("path"))))
    return TokenFileSwitch(file, {**read, **tokenizer}, earlier)


class TokenBatches:
    """Endless (inputs, labels) batches for one data-parallel rank: [global_batch_size // dp_size, seq_len] longs.

    The global batch is global_batch_size consecutive windows of the packed stream, identical for any dp_size;
    rank r keeps rows [r * B, (r + 1) * B). Labels are the inputs shifted by one token. data=synthetic draws
    uniform random ids instead, seeded by (seed, step); `seed` is used for nothing else (the corpus order is fixed).
    data=tokens reads the stream from a token file, only rank r's rows of it.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, global_batch_size: int, seq_len: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, threads: int = 1):
        check_global_batch(global_batch_size, dp_size)
        self.cfg, self.tokenizer = cfg, tokenizer
        # `threads` tokenize the documents after the current one while this thread reads the next (tiktoken
        # releases the GIL), READ_AHEAD each; a document that cannot be read is raised when its turn comes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="membudget-tokenize") if threads > 1 else None
        self._read_ahead = read_ahead(threads)
        self.global_batch_size, self.seq_len, self.seed = global_batch_size, seq_len, seed
        local = global_batch_size // dp_size
        self.rows = slice(dp_rank * local, (dp_rank + 1) * local)
        self._token_file = open_token_file(cfg, tokenizer) if cfg.name == DataName.tokens else None
        self._documents = None if cfg.name in (DataName.synthetic, DataName.tokens) else Documents(cfg)
        self._peeked: Optional[tuple[dict, tuple[torch.Tensor, torch.Tensor]]] = None  # (position before, batch)
        self.load_state_dict({"step": 0, "epoch": 0, "doc": 0, "offset": 0})

    def state_dict(self) -> dict:
        """Where the next batch starts: `offset` tokens into document `doc` of epoch `epoch`; for a streamed
        Hugging Face dataset also the stream's position at or before that document (`hub`)."""
        if self._peeked is not None:
            return dict(self._peeked[0])
        state = {"step": self.step, "epoch": self.epoch, "doc": self.doc, "offset": self.offset}
        if isinstance(self._docs, HubDocuments):
            state["hub"] = self._docs.position(self.doc)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.doc, self.offset = state["step"], state["epoch"], state["doc"], state["offset"]
        self._tokens: Optional[np.ndarray] = None  # tokens of document `doc`, read when first needed
        self._peeked = None
        self._open_reader(state.get("hub"))

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, read now and still handed out by the next `next()`, with the position before it until
        then: the trainer's check that the data has text, before anything is written, without reading the batch
        (and opening a Hub stream) a second time."""
        if self._peeked is None:
            before = self.state_dict()
            self._peeked = (before, next(self))
        return self._peeked[1]

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._peeked is not None:
            batch, self._peeked = self._peeked[1], None
            return batch
        shape = (self.global_batch_size, self.seq_len + 1)
        if self.cfg.name == DataName.synthetic:
            # numpy mixes (seed, step) into one stream; torch's CPU generator would keep only 32 bits of a seed.
            rng = np.random.default_rng((self.seed, self.step))
            windows = rng.integers(0, self.tokenizer.vocab_size, shape, dtype=np.int64)[self.rows]
        elif self._token_file is not None:
            windows = self._rows_of_token_file()
        else:
            # Every rank tokenizes the whole global batch, not only its rows: where rank r's rows start in the
            # stream depends on the token count of every document before them, which only tokenizing them
            # tells. That is what keeps the global batch identical for any data-parallel size (and a resume
            # position one (epoch, doc, offset) for all ranks); the Prefetcher's thread hides the cost, and a
            # token file (above) does away with it.
            windows = self._take(shape[0] * shape[1]).reshape(shape)[self.rows]
        windows = torch.from_numpy(np.ascontiguousarray(windows))
        self.step += 1
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _rows_of_token_file(self) -> np.ndarray:
        """This rank's rows of the next global batch, read from the token file (one document: `offset` counts
        its tokens), and the position moved past the whole batch."""
        window, length = self.seq_len + 1, len(self._token_file)
        start = self.epoch * length + self.offset
        rows = self._token_file.read(start + self.rows.start * window, (self.rows.stop - self.rows.start) * window)
        self.epoch, self.offset = divmod(start + self.global_batch_size * window, length)
        return rows.reshape(-1, window)

    def _open_reader(self, resume: Optional[dict] = None) -> None:
        self._docs = self._tokenized = None  # what was read ahead of the old position is dropped
        if self._documents is None:  # synthetic, a token file
            return
        self._docs = self._documents.read(start=self.doc, resume=resume)
        self._tokenized = TokenizedDocuments(self._docs, self.tokenizer, self._pool, self._read_ahead)
        # An epoch read from its first document that yields no token means the corpus has no text at all.
        self._from_epoch_start, self._epoch_tokens = self.doc == 0, 0

    def _take(self, n: int) -> np.ndarray:
        """The next n tokens of the packed stream, crossing document and epoch boundaries."""
        chunks, missing = [], n
        while missing:
            if self._tokens is None:
                self._tokens = self._read_document()
            if self.offset == len(self._tokens):
                self.doc, self.offset, self._tokens = self.doc + 1, 0, None
                continue
            chunk = self._tokens[self.offset:self.offset + missing]
            chunks.append(chunk)
            self.offset += len(chunk)
            missing -= len(chunk)
        return np.concatenate(chunks)

    def _read_document(self) -> np.ndarray:
        tokens = next(self._tokenized, None)
        if tokens is None:  # the epoch's end
            if self._from_epoch_start and self._epoch_tokens == 0:
                hf = self.cfg.name == DataName.hf
                key, value = ("data.hf_path", self.cfg.hf_path) if hf else ("data.path", self.cfg.path)
                raise UserError(f"{key}={value!r}: the dataset has no text at all; point {key} at data with text")
            self.epoch, self.doc = self.epoch + 1, 0
            self._open_reader()
            return self._read_document()
        self._epoch_tokens += len(tokens)
        return tokens

    def rereads(self, steps: int) -> Optional[str]:
        """A line when the next `steps` batches read past the end of the token file (its documents again): how many
        tokens they read, and how many it holds. None within the file, and for a source (whose length is known
        only once read: Prefetcher says so at the step that reads past it)."""
        if self._token_file is None:
            return None
        length, read = len(self._token_file), steps * self.global_batch_size * (self.seq_len + 1)
        end = self.epoch * length + self.offset + read
        if end <= (self.epoch + 1) * length:
            return None
        return (f"data.path={self.cfg.path}: holds {length:,} tokens, and the {steps:,} steps to train.steps read "
                f"{read:,} from its token {self.offset:,} of epoch {self.epoch}, to epoch {(end - 1) // length}: "
                f"its documents are read again; to read each once, write a token file of more of the source (a larger "
                f"--most-tokens) and rerun with it before then: the run goes on on it from its checkpoint's token")

    def close(self) -> None:
        """The tokenizing threads end (a run's end; the batches are not read after it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class Prefetcher:
    """The batches of `batches`, in the same order, with the next `depth` of them prepared in a background
    thread (tokenized, this rank's rows, pinned for a non-blocking copy to the GPU) while the current step runs.

    `state_dict()` is the position after the last batch handed out, not after those read ahead, so a checkpoint
    resumes exactly there; a batch handed out in a new epoch of the data says so (`_handed_out`). An exception in
    the thread (a bad line further into the data) is raised by the `next()` that would have returned that batch,
    and by every one after it. depth=0: no thread."""

    def __init__(self, batches: TokenBatches, depth: int, pin: bool = False):
        self.batches, self.depth, self.pin = batches, depth, pin
        self._state = batches.state_dict()
        self._ready: queue.Queue = queue.Queue()  # (inputs, labels, state after them) or the exception
        self._free_slots = threading.Semaphore(depth)  # at most `depth` batches prepared and not yet handed out
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _fill(self) -> None:
        while True:
            self._free_slots.acquire()
            if self._stop.is_set():
                return
            try:
                inputs, labels = next(self.batches)
                if self.pin:
                    inputs, labels = inputs.pin_memory(), labels.pin_memory()
                self._ready.put((inputs, labels, self.batches.state_dict()))
            except BaseException as e:  # handed to the training thread, which raises it
                self._ready.put(e)
                return

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._error is not None:
            raise self._error
        if self.depth == 0:
            inputs, labels = next(self.batches)
            self._handed_out(self.batches.state_dict())
            return inputs, labels
        if self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="membudget-data", daemon=True)
            self._thread.start()
        item = self._ready.get()
        if isinstance(item, BaseException):
            self._error = item
            raise item
        self._free_slots.release()
        inputs, labels, state = item
        self._handed_out(state)
        return inputs, labels

    def _handed_out(self, state: dict) -> None:
        """The position after a batch handed out; said when the batch starts another epoch: a run that reads its
        documents more than once (a small corpus, a token file of the source's first documents) says by which step.
        Said here, not where the batches are read ahead, which may be past the run's last step."""
        if state["epoch"] > self._state["epoch"]:
            log.warning("data: epoch %d of %s starts by step %d: the run reads its documents again", state["epoch"],
                        source_words(self.batches.cfg), state["step"])
        self._state = state

    def state_dict(self) -> dict:
        return dict(self._state)

    def close(self) -> None:
        """Stop the thread: it finishes the batch it is preparing, if any, and exits."""
        self._stop.set()
        self._free_slots.release()  # wakes the thread if it waits for a free slot
        if self._thread is not None:
            self._thread.join(timeout=10)
