"""A corpus tokenized once (data=tokens): what `python -m membudget.pretokenize` writes and the batches read.

A token file is a directory:
    tokens.bin  every document's ids (BOS, its text's, EOS) in the corpus's order, little-endian uint16 or uint32
                (the smallest that holds the tokenizer's ids): the stream TokenBatches packs on the fly
    starts.bin  where each of the source's documents starts in tokens.bin (little-endian uint64; an empty one
                where the next does): how a run started on the source continues on the file (format 2)
    meta.json   the dtype, the counts, the tokenizer and the source it was made from

It is written in `.<name>.partial` beside its path (with progress.json, where the write stands) and renamed onto
the path once whole: a write that stops is continued by the same command.

Read through a memory map: a rank reads its own rows of each global batch, B x (seq_len + 1) tokens at a known
offset, and nothing else; no rank tokenizes, and none reads the global batch. The stream is the one the source
gives on the fly, so the batches are the same as those of a run over the source (data.TokenBatches), and a run
started on the source continues on the file from the same token (`TokenFile.position_of`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional, Protocol

import numpy as np

from membudget.dirlock import DirLock
from membudget.errors import UserError
from membudget.metrics import write_json
from membudget.units import fmt_bytes

log = logging.getLogger("membudget")

FORMAT = 2  # what this version writes; 1 had no starts.bin
READABLE = (1, 2)
TOKENS, STARTS, META, PROGRESS = "tokens.bin", "starts.bin", "meta.json", "progress.json"
START = np.dtype("<u8")
# How often a write saves where it stands: what a stopped write (SIGKILL) may have to redo at most
SAVE_EVERY_S = 30.0
COMMAND = "python -m membudget.pretokenize OUT <the source's data= and tokenizer= overrides>"


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class Source(Protocol):
    """The documents' ids from any document on: what a token file is written from (pretokenize)."""

    def read(self, start: int, resume: Optional[dict]) -> Iterator[np.ndarray]:
        """The ids of every document from the `start`-th (empty ones count), from `resume` (position()) if given."""

    def position(self, doc: int) -> Optional[dict]:
        """Where document `doc`, just after the last one read, lies in a stream that cannot seek by index."""


def partial_dir(out: Path) -> Path:
    """Where the token file `out` is written until it is whole: beside it, renamed onto it at the end."""
    return out.with_name(f".{out.name}.partial")


def write(out: Path, source: Source, meta: dict, vocab_size: int, most_tokens: Optional[int] = None,
          progress: Callable[[int, int], None] = lambda documents, tokens: None) -> dict:
    """Write the token file `out` from the ids of `source`'s documents, up to the first document that takes the
    count to `most_tokens` (whole documents: the file is a prefix of the stream); `meta`: what made them
    (tokenizer, source), kept in meta.json. Returns meta.json's content.

    The file appears whole or not at all: it is written into partial_dir(out), one writer at a time (a lock), and
    renamed onto `out`; an existing `out` is never touched. Where it stands is saved there every SAVE_EVERY_S (the
    ids flushed up to it first). A write that stops (a full disk, an interrupt, SIGTERM, SIGKILL) keeps what it
    wrote, and the same command continues from the last saved point; a partial dir made from another source,
    tokenizer or --most-tokens is started over."""
    out = Path(out)
    refuse_existing(out)
    dtype = dtype_for(vocab_size)
    made = {**meta, "format": FORMAT, "dtype": dtype.str, "most_tokens": most_tokens}  # None: the whole source
    partial = partial_dir(out)
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"pretokenize: cannot write {out} ({e.strerror or e}); choose another path") from None
    lock = DirLock(partial, name=f"pretokenize {out}", holder="another pretokenize",
                   fix="wait for it to end, or write the token file elsewhere")
    lock.acquire()
    try:
        written = _write_into(partial, source, made, dtype, most_tokens, progress)
    except UserError:  # a record it cannot read, say: what was written stays for the same command
        raise
    except OSError as e:
        free = shutil.disk_usage(out.parent).free if out.parent.is_dir() else None
        room = "" if free is None else f" ({fmt_bytes(free)} free there)"
        raise UserError(f"pretokenize: cannot write {out} ({e.strerror or e}){room}; the ids written so far are kept "
                        f"in {partial}: free space and run the same command to continue (or remove it)") from None
    except BaseException:  # an interrupt, SIGTERM: the same command continues from the last saved point
        log.warning("pretokenize: stopped; the %s tokens written by then are kept in %s: run the same command to "
                    "continue", f"{_saved_tokens(partial):,}", partial)
        raise
    finally:
        lock.release()  # before the rename: the token file holds no lock file
    try:
        os.replace(partial, out)
    except OSError as e:  # `out` made meanwhile by something else
        raise UserError(f"pretokenize: cannot rename {partial} to {out} ({e.strerror or e}); the token file is "
                        f"whole in {partial}: move it where it belongs") from None
    return written


def _write_into(partial: Path, source: Source, made: dict, dtype: np.dtype, most_tokens: Optional[int],
                progress) -> dict:
    """The token file written whole in `partial`, from where an earlier write stopped: its meta.json's content."""
    at = _resume_point(partial, made, dtype)
    with open(partial / TOKENS, "r+b" if at["tokens"] else "wb") as f, \
            open(partial / STARTS, "r+b" if at["doc"] else "wb") as starts:
        # what was written after the last save is written again now
        for file, size in ((f, at["tokens"] * dtype.itemsize), (starts, at["doc"] * START.itemsize)):
            file.truncate(size)
            file.seek(0, os.SEEK_END)
        try:
            _write_ids(f, starts, source, dtype, at, most_tokens, progress,
                       lambda: _save(partial, (f, starts), made, at, source))
        except BaseException:  # an interrupt, SIGTERM, a full disk: the point reached, if it can still be saved
            with contextlib.suppress(Exception):
                _save(partial, (f, starts), made, at, source)
            raise
    if at["tokens"] == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError("pretokenize: the source has no text at all; point data.path (or data.hf_path) at data "
                        "with text")
    # documents: those with ids; source_documents: every one read, empty ones too (starts.bin's length)
    written = {**made, "tokens": at["tokens"], "documents": at["documents"], "source_documents": at["doc"]}
    (partial / META).write_text(json.dumps(written, indent=2) + "\n")
    (partial / PROGRESS).unlink(missing_ok=True)
    return written


def _write_ids(f, starts, source: Source, dtype: np.dtype, at: dict, most_tokens: Optional[int], progress,
               save) -> None:
    """The documents' ids from the point `at` on, appended to `f`, and where each starts to `starts`, with `at`
    moved past each document only once both are written (one update: an interrupt between the two redoes the
    document); saved every SAVE_EVERY_S."""
    saved = time.monotonic()
    for ids in source.read(at["doc"], at["resume"]):
        starts.write(np.array(at["tokens"], dtype=START).tobytes())
        if len(ids):
            f.write(np.asarray(ids).astype(dtype, copy=False).tobytes())
        at.update(doc=at["doc"] + 1, documents=at["documents"] + bool(len(ids)), tokens=at["tokens"] + len(ids))
        progress(at["documents"], at["tokens"])
        done = most_tokens is not None and at["tokens"] >= most_tokens
        if done or time.monotonic() - saved >= SAVE_EVERY_S:
            save()
            saved = time.monotonic()
        if done:
            return


def _resume_point(partial: Path, made: dict, dtype: np.dtype) -> dict:
    """Where an earlier write of the same file stopped (its last saved point), else the start."""
    start = {"doc": 0, "documents": 0, "tokens": 0, "resume": None}
    try:
        saved = json.loads((partial / PROGRESS).read_text())
        size, starts = (partial / TOKENS).stat().st_size, (partial / STARTS).stat().st_size
    except (OSError, ValueError):
        return start  # none, or cut short by a full disk: the start
    if not isinstance(saved, dict) or saved.get("made") != made:
        log.warning("pretokenize: starting over in %s: what is there was written from another source, tokenizer or "
                    "--most-tokens", partial)
        return start
    at = saved["at"]
    for name, have, need in ((TOKENS, size, at["tokens"] * dtype.itemsize),
                             (STARTS, starts, at["doc"] * START.itemsize)):
        if have < need:  # shorter than saved: not the file the point was saved for
            log.warning("pretokenize: starting over in %s: %s is shorter than its saved point", partial, name)
            return start
    log.info("pretokenize: continuing an earlier write from document %s (%s tokens of %s documents kept)",
             f"{at['doc']:,}", f"{at['tokens']:,}", f"{at['documents']:,}")
    return dict(at)


def _save(partial: Path, files, made: dict, at: dict, source: Source) -> None:
    """The ids (and starts) written so far on disk, then the point after them (atomically): what a rerun continues
    from."""
    for f in files:
        f.flush()
        os.fsync(f.fileno())
    write_json(partial / PROGRESS, {"made": made, "at": {**at, "resume": source.position(at["doc"])}})


def _saved_tokens(partial: Path) -> int:
    try:
        return json.loads((partial / PROGRESS).read_text())["at"]["tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def refuse_existing(out: Path) -> None:
    """A token file is never written over (nor anything else at its path)."""
    if out.exists():
        raise UserError(f"pretokenize: {out} already exists; remove it or choose another path for the token file")


class TokenFile:
    """A token file, read through a memory map: `meta` (meta.json) and `read(start, n)`, the n tokens from
    position `start` of the stream the file repeats epoch after epoch; `position_of`, where a run over its source
    continues in it."""

    def __init__(self, path: Optional[str]):
        if not path:
            raise UserError(f"data.path={path!r}: data=tokens reads a token file; point data.path at one, or write one "
                            f"with {COMMAND}")
        self.path, self.where = Path(os.path.expanduser(path)), f"data.path={path!r}"
        if not (self.path / META).is_file():
            what = ("is not a token file (no meta.json: its writing was cut short, or it is a corpus to tokenize)"
                    if self.path.is_dir() else "does not exist" if not self.path.exists() else "is not a token file")
            raise UserError(f"{self.where}: {what}; write one with {COMMAND}")
        try:
            self.meta = json.loads((self.path / META).read_text())
            dtype, count = np.dtype(self.meta["dtype"]), int(self.meta["tokens"])
            if self.meta.get("format") not in READABLE:
                raise ValueError(f"format {self.meta.get('format')!r}, this version reads {READABLE}")
            documents = int(self.meta["source_documents"]) if self.meta["format"] >= 2 else None
            if count < 1:
                raise ValueError(f"{count} tokens")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{self.where}: cannot read its meta.json ({type(e).__name__}: {e}); write it again with "
                            f"{COMMAND}") from None
        self.tokens = self._mapped(TOKENS, dtype, count, "tokens")
        self.starts = None if documents is None else self._mapped(STARTS, START, documents, "documents")  # format 1

    def _mapped(self, name: str, dtype: np.dtype, count: int, what: str) -> np.memmap:
        """The file `name` of `count` values of `dtype` (`what` they count), memory-mapped, where its size says it
        is whole; else one line."""
        size = (self.path / name).stat().st_size if (self.path / name).is_file() else None
        if size != count * dtype.itemsize:
            raise UserError(f"{self.where}: {name} has {size} bytes where meta.json says {count:,} {what} of "
                            f"{dtype.itemsize} bytes (a copy cut short?); copy it again, or write it again with "
                            f"{COMMAND}")
        return np.memmap(self.path / name, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the file repeated endlessly, as int64."""
        out = np.empty(n, dtype=np.int64)
        done, at = 0, start % len(self.tokens)
        while done < n:
            chunk = self.tokens[at:at + n - done]
            out[done:done + len(chunk)] = chunk
            done, at = done + len(chunk), 0
        return out

    def position_of(self, state: dict, earlier: Optional["TokenFile"] = None) -> dict:
        """Where a run over this file's source at `state` (data.TokenBatches' state: `offset` tokens into document
        `doc` of epoch `epoch`) continues in the file: its next token, as a state of a run over the file; or, with
        `earlier`, a run over another token file of the same source at `state`. A file of the whole source continues
        any position; one of its first documents (--most-tokens) a position before its end, in the first epoch, as
        does a run over one (whose later epochs read those documents again, which the source does not)."""
        length, whole = len(self.tokens), self.meta.get("most_tokens") is None
        if earlier is not None:
            epoch, offset = state["epoch"], state["offset"]
            if len(earlier) == length:  # the same documents of the same source (a copy, a move): the same stream
                return {"step": state["step"], "epoch": epoch, "doc": 0, "offset": offset}
            if whole and earlier.meta.get("most_tokens") is None:
                raise UserError(f"{self.where}: holds {length:,} tokens of the whole source, and {earlier.where} "
                                f"{len(earlier):,}: not of the same source; continue on {earlier.where}")
            if epoch > 0:
                raise UserError(f"{self.where}: the run has read the documents of {earlier.path} again (epoch "
                                f"{epoch}), which a run over their source does not, so no place in another file of "
                                f"that source is where it stands; continue on {earlier.where}, or start a run on "
                                f"this one")
            position = offset
        else:
            if self.starts is None:
                raise UserError(f"{self.where}: written by an older version, which kept no {STARTS} (where each "
                                f"document starts), so a run over its source cannot continue on it; write it again "
                                f"with {COMMAND}")
            epoch, doc, offset, n = state["epoch"], state["doc"], state["offset"], len(self.starts)
            begins = int(self.starts[doc]) if doc < n else length
            ends = int(self.starts[doc + 1]) if doc + 1 < n else length
            if (whole and doc >= n) or (doc < n and offset > ends - begins):
                raise UserError(f"{self.where}: the run is {offset:,} tokens into document {doc:,} of its source, "
                                f"where this file has {n:,} documents and that one {max(ends - begins, 0):,} tokens "
                                f"long: not the source it was made from; continue on the source, or write the token "
                                f"file again with {COMMAND}")
            position = begins + offset
        if not whole and (epoch > 0 or position >= length):
            raise UserError(f"{self.where}: holds the source's first {length:,} tokens (--most-tokens "
                            f"{self.meta['most_tokens']:,}), and the run is past them (epoch {epoch}, token "
                            f"{position:,}); write a token file of more of the source (a larger --most-tokens, or "
                            f"none for the whole) to continue on it, or continue on what the run read")
        epoch, offset = divmod(epoch * length + position, length)
        return {"step": state["step"], "epoch": epoch, "doc": 0, "offset": offset}
