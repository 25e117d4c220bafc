"""Tokenizers: UTF-8 bytes (no file) and Llama 3's tiktoken BPE (Meta's tokenizer.model), each with the ids a
token file and a resume compare it by (its name, vocabulary and file).

    build_tokenizer(cfg.tokenizer)  -> a Tokenizer: encode (BOS, the text's ids, EOS), decode, identity()
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from unittest import mock

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from membudget.errors import UserError
from membudget.options import choices, option_for
from membudget.schema import TokenizerConfig, TokenizerName


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

    def encode_array(self, text: str) -> np.ndarray:
        """encode(text) (with BOS and EOS) as int64 ids: what the batches pack."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def identity(self) -> dict:
        """What makes its ids: its name and vocabulary size (and its file's fingerprint), kept in a token file."""
        return {"name": self.name, "vocab_size": self.vocab_size}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS=256 and EOS=257: no file needed, any text round-trips."""

    name, vocab_size, bos_id, eos_id = TokenizerName.byte.value, 258, 256, 257

    def _encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_array(self, text: str) -> np.ndarray:
        # the same ids as encode(), without a Python int per byte
        utf8 = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return np.concatenate([[self.bos_id], utf8, [self.eos_id]]).astype(np.int64)


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

    name = TokenizerName.tiktoken.value

    def __init__(self, path: str | None):
        self.path = path
        fix = "point tokenizer.path at Meta's Llama 3 tokenizer.model (original/tokenizer.model in the model download)"
        if not path:
            option = option_for("tokenizer", "name", TokenizerName.tiktoken)
            raise UserError(f"tokenizer.path={path!r}: {option} needs a file; {fix}")
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

    def identity(self) -> dict:
        return {**super().identity(), "file": file_fingerprint(self.path)}


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.name == TokenizerName.byte:
        return ByteTokenizer()
    if cfg.name == TokenizerName.tiktoken:
        return Llama3Tokenizer(cfg.path)
    raise UserError(f"tokenizer.name={cfg.name!r}: unknown tokenizer; choose one of {choices('tokenizer')}")


def vocab_size_check(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """The tokenizer's largest id must index the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError(
            f"model.vocab_size={model_vocab_size!r}: the {type(tokenizer).__name__} needs {tokenizer.vocab_size} ids; "
            f"set model.vocab_size={tokenizer.vocab_size} or more, or choose another of {choices('tokenizer')}"
        )


def tokenizer_words(identity: dict) -> str:
    """A tokenizer as the user chose it: tokenizer=llama3 (tokenizer.model, 2,183,982 bytes), 128256 ids."""
    name = identity.get("name")
    words = option_for("tokenizer", "name", name) or f"tokenizer.name={name}"
    file = identity.get("file")
    if file:
        words += f" ({file[0]}, " + ("missing" if file[1] is None else f"{file[1]:,} bytes") + ")"
    return words + f", {identity.get('vocab_size')} ids"


def file_fingerprint(path: str) -> list:
    """[name, size, digest] of a file read whole (a tokenizer's); size and digest None where it is missing."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):  # build_tokenizer says so in one line
        return [os.path.basename(path), None, None]
    with open(path, "rb") as f:
        content = f.read()
    return [os.path.basename(path), len(content), digest(content)]


def digest(content: bytes) -> str:
    """The fingerprint's digest of some bytes (128-bit BLAKE2b: collisions are not a concern here)."""
    return hashlib.blake2b(content, digest_size=16).hexdigest()
