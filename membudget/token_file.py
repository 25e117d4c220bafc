"""A corpus tokenized once (data=tokens): what `python -m membudget.pretokenize` writes and the batches read.

A token file is a directory:
    tokens.bin  every document's ids (BOS, its text's, EOS) in the corpus's order, little-endian uint16 or uint32
                (the smallest that holds the tokenizer's ids): the stream TokenBatches packs on the fly
    meta.json   the dtype, the counts, the tokenizer and the source it was made from; written last, so a dir
                without it is one whose writing was cut short

Read through a memory map: a rank reads its own rows of each global batch, B x (seq_len + 1) tokens at a known
offset, and nothing else; no rank tokenizes, and none reads the global batch. The stream is the one the source
gives on the fly, so the batches are the same as those of a run over the source (data.TokenBatches).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from membudget.errors import UserError
from membudget.units import fmt_bytes

FORMAT = 1
TOKENS, META = "tokens.bin", "meta.json"
COMMAND = "python -m membudget.pretokenize OUT <the source's data= and tokenizer= overrides>"


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write(out: Path, documents: Iterable[np.ndarray], meta: dict, vocab_size: int, most_tokens: Optional[int] = None,
          progress: Callable[[int, int], None] = lambda documents, tokens: None) -> dict:
    """Write the token file `out` from the token ids of `documents` (each an array of ids, in order), up to the
    first document that takes the count to `most_tokens` (whole documents: the file is a prefix of the stream);
    `meta`: what made them (tokenizer, source), kept in meta.json. The file appears whole or not at all: it is
    written beside `out` and renamed onto it; a failure (a full disk, an interrupt) removes what it wrote, and an
    existing `out` is never touched. Returns meta.json's content."""
    out = Path(out)
    refuse_existing(out)
    dtype = dtype_for(vocab_size)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        n_documents = n_tokens = 0
        with open(partial / TOKENS, "wb") as f:
            for ids in documents:
                if len(ids) == 0:
                    continue
                f.write(np.asarray(ids).astype(dtype, copy=False).tobytes())
                n_documents, n_tokens = n_documents + 1, n_tokens + len(ids)
                progress(n_documents, n_tokens)
                if most_tokens is not None and n_tokens >= most_tokens:
                    break
        if n_tokens == 0:
            raise UserError("pretokenize: the source has no text at all; point data.path (or data.hf_path) at data "
                            "with text")
        written = {**meta, "format": FORMAT, "dtype": dtype.str, "tokens": n_tokens, "documents": n_documents,
                   "most_tokens": most_tokens}  # None: the whole source
        (partial / META).write_text(json.dumps(written, indent=2) + "\n")
        os.replace(partial, out)
        return written
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        free = shutil.disk_usage(out.parent).free if out.parent.is_dir() else None
        room = "" if free is None else f" ({fmt_bytes(free)} free there)"
        raise UserError(f"pretokenize: cannot write {out} ({e.strerror or e}){room}; nothing was kept: free space "
                        f"or choose another path, then run it again") from None
    except BaseException:  # a UserError, an interrupt: nothing half-written stays
        shutil.rmtree(partial, ignore_errors=True)
        raise


def refuse_existing(out: Path) -> None:
    """A token file is never written over (nor anything else at its path)."""
    if out.exists():
        raise UserError(f"pretokenize: {out} already exists; remove it or choose another path for the token file")


class TokenFile:
    """A token file, read through a memory map: `meta` (meta.json) and `read(start, n)`, the n tokens from
    position `start` of the stream the file repeats epoch after epoch."""

    def __init__(self, path: Optional[str]):
        if not path:
            raise UserError(f"data.path={path!r}: data=tokens reads a token file; point data.path at one, or write one "
                            f"with {COMMAND}")
        self.path = Path(os.path.expanduser(path))
        where = f"data.path={path!r}"
        if not (self.path / META).is_file():
            what = ("is not a token file (no meta.json: its writing was cut short, or it is a corpus to tokenize)"
                    if self.path.is_dir() else "does not exist" if not self.path.exists() else "is not a token file")
            raise UserError(f"{where}: {what}; write one with {COMMAND}")
        try:
            self.meta = json.loads((self.path / META).read_text())
            dtype, count = np.dtype(self.meta["dtype"]), int(self.meta["tokens"])
            if self.meta.get("format") != FORMAT:
                raise ValueError(f"format {self.meta.get('format')!r}, this version reads {FORMAT}")
            if count < 1:
                raise ValueError(f"{count} tokens")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{where}: cannot read its meta.json ({type(e).__name__}: {e}); write it again with "
                            f"{COMMAND}") from None
        size = (self.path / TOKENS).stat().st_size if (self.path / TOKENS).is_file() else None
        if size != count * dtype.itemsize:
            raise UserError(f"{where}: {TOKENS} has {size} bytes where meta.json says {count:,} tokens of "
                            f"{dtype.itemsize} bytes (a copy cut short?); copy it again, or write it again "
                            f"with {COMMAND}")
        self.tokens = np.memmap(self.path / TOKENS, dtype=dtype, mode="r", shape=(count,))

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
