"""A corpus tokenized once (python -m membudget.pretokenize, data=tokens): the batches of its source on every
data-parallel rank and across epochs and resumes, each rank reading only its own rows; a file written whole or
not at all; a file that is not whole, or made by another tokenizer, refused in one line."""

import json
import logging

import numpy as np
import pytest
import torch

from membudget.data import Llama3Tokenizer, TokenBatches, data_changes, data_fingerprint
from membudget.errors import UserError
from membudget.pretokenize import main, pretokenize
from membudget.token_file import META, TOKENS, TokenFile, write
from tests.conftest import TINY, compose_cfg, read_metrics, small_tmpfs, train_here
from tests.test_data import hf_cache_in_tmp, one_line_error, write_bpe, write_jsonl  # noqa: F401 (autouse)


def _corpus(tmp_path):
    """A jsonl corpus with empty documents among the others, and a BPE tokenizer for it: (source overrides)."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"the {i} th" * (i % 5)} for i in range(300)])
    return ["data=jsonl", f"data.path={tmp_path / 'a.jsonl'}", "tokenizer=llama3",
            f"tokenizer.path={write_bpe(tmp_path / 'tokenizer.model')}"]


def test_a_token_file_gives_its_sources_batches_on_each_rank_over_epochs_and_resumes(tmp_path):
    source = _corpus(tmp_path)
    meta = pretokenize(compose_cfg(*source), tmp_path / "a.tokens", threads=2)
    assert meta["documents"] == 240 and meta["dtype"] == "<u2"  # the 60 empty ones add nothing; 516 ids fit
    tokenizer = Llama3Tokenizer(str(tmp_path / "tokenizer.model"))
    data = compose_cfg(*source[:2]).data
    tokens = compose_cfg("data=tokens", f"data.path={tmp_path / 'a.tokens'}").data

    def batches(cfg, dp_rank=0, dp_size=1):
        return TokenBatches(cfg, tokenizer, global_batch_size=4, seq_len=31, seed=0, dp_rank=dp_rank, dp_size=dp_size)

    whole, one, ranks = batches(data), batches(tokens), [batches(tokens, r, 2) for r in range(2)]
    reads = []  # what each rank of two reads from the file: its own rows of each batch, nothing else
    file_read = ranks[1]._token_file.read
    ranks[1]._token_file.read = lambda start, n: reads.append((start, n)) or file_read(start, n)
    states, want = [], []
    steps = 2 * meta["tokens"] // (4 * 32) + 3  # two epochs and a bit
    for step in range(steps):
        states.append(json.loads(json.dumps(one.state_dict())))
        want.append(next(whole))
        assert torch.equal(next(one)[0], want[-1][0]) and torch.equal(want[-1][1][:, :-1], want[-1][0][:, 1:]), step
        rows = [next(rank) for rank in ranks]
        assert torch.equal(torch.cat([r[0] for r in rows]), want[-1][0]), step
        assert torch.equal(torch.cat([r[1] for r in rows]), want[-1][1]), step
    assert whole.epoch == one.epoch == 2
    assert reads == [(step * 4 * 32 + 2 * 32, 2 * 32) for step in range(steps)]
    for i in (1, steps // 2, steps - 4):  # a resume from any position, on any data-parallel size
        resumed = [batches(tokens, r, 2) for r in range(2)]
        for rank in resumed:
            rank.load_state_dict(states[i])
        for step in range(i, i + 3):
            assert torch.equal(torch.cat([next(rank)[0] for rank in resumed]), want[step][0]), (i, step)


def test_a_run_over_a_token_file_has_the_losses_of_a_run_over_its_source(tmp_path):
    pretokenize(compose_cfg(), tmp_path / "pydoc.tokens")  # the default corpus and tokenizer
    over_source = train_here(tmp_path / "source", *TINY)
    over_file = train_here(tmp_path / "file", *TINY, "data=tokens", f"data.path={tmp_path / 'pydoc.tokens'}")
    assert over_file["final_loss"] == over_source["final_loss"]
    losses = {name: [m["loss"] for m in read_metrics(tmp_path / name)] for name in ("source", "file")}
    assert losses["file"] == losses["source"] and len(losses["file"]) == 3


def test_most_tokens_writes_the_streams_first_whole_documents(tmp_path):
    source = _corpus(tmp_path)
    meta = pretokenize(compose_cfg(*source), tmp_path / "a.tokens", most_tokens=100)
    whole = pretokenize(compose_cfg(*source), tmp_path / "all.tokens")
    assert meta["most_tokens"] == 100 and whole["most_tokens"] is None
    first, all_ = TokenFile(str(tmp_path / "a.tokens")), TokenFile(str(tmp_path / "all.tokens"))
    assert 100 <= len(first) < 100 + 60 and np.array_equal(first.tokens, all_.tokens[:len(first)])
    eos = Llama3Tokenizer(str(tmp_path / "tokenizer.model")).eos_id
    assert first.tokens[-1] == eos and meta["documents"] < whole["documents"]


def test_a_token_file_is_written_whole_or_not_at_all(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="membudget")
    out = tmp_path / "a.tokens"
    pretokenize(compose_cfg(), out, most_tokens=1000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # an existing file is never touched
    assert main([str(out)]) == 2 and "already exists; remove it or choose another path" in caplog.text
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # no source
    assert main([str(tmp_path / "b.tokens"), "data=synthetic"]) == 2 and "has no documents to tokenize" in caplog.text
    assert main([str(tmp_path / "b.tokens"), "data=nonsense"]) == 2 and "data=nonsense" in caplog.text
    # an interrupt while writing: nothing of it stays
    interrupted = tmp_path / "c.tokens"

    def documents():
        yield np.arange(10)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write(interrupted, documents(), {}, vocab_size=258)
    assert not interrupted.exists() and not list(tmp_path.glob(".c.tokens*"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_full_disk_keeps_nothing_of_the_token_file_and_says_so(tmp_path):
    with small_tmpfs(tmp_path, "256k") as disk:
        small = disk / "small.tokens"
        pretokenize(compose_cfg(), small, most_tokens=1000)
        kept = {p.name: p.read_bytes() for p in small.iterdir()}
        with pytest.raises(UserError) as info:
            pretokenize(compose_cfg(), disk / "pydoc.tokens")  # 0.9 MB of byte tokens
        message = str(info.value)
        assert "\n" not in message and "cannot write" in message and "free space" in message, message
        assert sorted(p.name for p in disk.iterdir()) == ["small.tokens"]
        assert {p.name: p.read_bytes() for p in small.iterdir()} == kept


def test_a_token_file_that_is_not_whole_or_of_another_tokenizer_is_one_line(tmp_path):
    tokenizer = Llama3Tokenizer(write_bpe(tmp_path / "tokenizer.model"))
    out = tmp_path / "a.tokens"
    n = pretokenize(compose_cfg(), out, most_tokens=1000)["tokens"]  # the byte tokenizer's: 2 bytes a token

    one_line_error("data.path=None: data=tokens reads a token file", TokenFile, None)
    one_line_error("does not exist", TokenFile, str(tmp_path / "none"))
    (tmp_path / "cut").mkdir()
    one_line_error("no meta.json: its writing was cut short", TokenFile, str(tmp_path / "cut"))
    # made by the byte tokenizer, read by a BPE one
    cfg = compose_cfg("data=tokens", f"data.path={out}")
    with pytest.raises(UserError) as info:
        TokenBatches(cfg.data, tokenizer, 2, 7, 0)
    assert ("its tokens were made by tokenizer=byte, 258 ids, this run's tokenizer is tokenizer=llama3 "
            "(tokenizer.model, ") in str(info.value) and "python -m membudget.pretokenize" in str(info.value)
    # a copy cut short: the fingerprint names the file that changed, and the file says what is wrong
    before = data_fingerprint(cfg.data)
    with open(out / TOKENS, "r+b") as f:
        f.truncate(100)
    assert data_changes(before, data_fingerprint(cfg.data)) == [f"tokens.bin is {2 * n:,} bytes then and 100 now"]
    one_line_error(f"tokens.bin has 100 bytes where meta.json says {n:,} tokens of 2 bytes", TokenFile, str(out))
    meta = json.loads((out / META).read_text())
    (out / META).write_text(json.dumps({**meta, "tokens": 0}))
    one_line_error("cannot read its meta.json (ValueError: 0 tokens)", TokenFile, str(out))
    (out / META).write_text("{")
    one_line_error("cannot read its meta.json", TokenFile, str(out))
