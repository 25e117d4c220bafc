"""A corpus tokenized once (python -m membudget.pretokenize, data=tokens): the batches of its source on every
data-parallel rank and across epochs and resumes, each rank reading only its own rows; a run started on the source
continued on the file; a file written whole or not at all; a file that is not whole, or made by another tokenizer
or from another source, refused in one line."""

import json
import logging
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from membudget import token_file
from membudget.data import Prefetcher, TokenBatches, data_changes, data_fingerprint, switch_to_token_file
from membudget.dirlock import DirLock
from membudget.errors import UserError
from membudget.pretokenize import SourceIds, main, made_from, pretokenize
from membudget.token_file import META, STARTS, TOKENS, TokenFile, partial_dir
from membudget.tokenizer import Llama3Tokenizer, build_tokenizer
from tests.conftest import TINY, compose_cfg, read_metrics, read_summary, small_tmpfs, train_here, wait_until
from tests.test_data import hf_cache_in_tmp, one_line_error, write_bpe, write_jsonl  # noqa: F401 (autouse)


def _corpus(tmp_path, documents=300):
    """A jsonl corpus with empty documents among the others, and a BPE tokenizer for it: (source overrides)."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"the {i} th" * (i % 5)} for i in range(documents)])
    return ["data=jsonl", f"data.path={tmp_path / 'a.jsonl'}", "tokenizer=llama3",
            f"tokenizer.path={write_bpe(tmp_path / 'tokenizer.model')}"]


def test_a_token_file_gives_its_sources_batches_on_each_rank_over_epochs_and_resumes(tmp_path):
    source = _corpus(tmp_path)
    meta = pretokenize(compose_cfg(*source), tmp_path / "a.tokens", threads=2)
    assert meta["documents"] == 240 and meta["dtype"] == "<u2"  # the 60 empty ones add nothing; 516 ids fit
    tokenizer = Llama3Tokenizer(str(tmp_path / "tokenizer.model"))
    # where each document of the source starts, the empty ones too (where the next one does)
    file, begins = TokenFile(str(tmp_path / "a.tokens")), 0
    assert meta["source_documents"] == len(file.starts) == 300
    for i, ids in enumerate(SourceIds(compose_cfg(*source).data, tokenizer, None, 1).read(0, None)):
        assert file.starts[i] == begins and np.array_equal(file.tokens[begins:begins + len(ids)], ids), i
        begins += len(ids)
    assert begins == len(file) == meta["tokens"]
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
        assert file.position_of(whole.state_dict()) == states[-1], step  # where a run over the source goes on
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


def test_a_token_file_is_never_written_over_and_a_source_without_documents_is_one_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="membudget")
    out = tmp_path / "a.tokens"
    pretokenize(compose_cfg(), out, most_tokens=1000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([str(out)]) == 2 and "already exists; remove it or choose another path" in caplog.text
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main([str(tmp_path / "b.tokens"), "data=synthetic"]) == 2 and "has no documents to tokenize" in caplog.text
    assert main([str(tmp_path / "b.tokens"), "data=nonsense"]) == 2 and "data=nonsense" in caplog.text
    write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 3)
    assert main([str(tmp_path / "b.tokens"), "data=jsonl", f"data.path={tmp_path / 'empty.jsonl'}"]) == 2
    assert "the source has no text at all" in caplog.text
    assert not list(tmp_path.glob("*b.tokens*"))  # nothing of it, partial or whole
    # one writer at a time
    partial_dir(tmp_path / "c.tokens").mkdir()
    held = DirLock(partial_dir(tmp_path / "c.tokens"))
    held.acquire()
    try:
        with pytest.raises(UserError, match=r"pretokenize .*c.tokens: another pretokenize is using it \(pid "):
            pretokenize(compose_cfg(), tmp_path / "c.tokens")
    finally:
        held.release()


@pytest.mark.parametrize("kind", ["jsonl", "hf"])
def test_a_stopped_pretokenize_continues_where_it_stopped_and_writes_the_same_file(tmp_path, monkeypatch, kind):
    """Stopped twice (an interrupt, SIGTERM) after a saved point, once with more written than its last saved point
    says (a SIGKILL between two saves): the same command continues and writes the file one uninterrupted write
    gives. A local corpus and a streamed dataset (whose saved point is the stream's own position), tokenized by
    two threads that read ahead."""
    overrides = _corpus(tmp_path, 700)
    if kind == "hf":
        overrides[:2] = ["data=c4", "data.hf_path=json", "data.hf_name=null",
                         f"data.hf_data_files={tmp_path / 'a.jsonl'}"]
    cfg = compose_cfg(*overrides)
    whole = pretokenize(cfg, tmp_path / "whole.tokens", threads=2)
    tokenizer = Llama3Tokenizer(str(tmp_path / "tokenizer.model"))
    out = tmp_path / "a.tokens"

    def stopped_after(documents: int, save_every_s: float):
        def progress(written: int, tokens: int) -> None:
            if written == documents:
                raise KeyboardInterrupt

        monkeypatch.setattr(token_file, "SAVE_EVERY_S", save_every_s)
        with ThreadPoolExecutor(2) as pool, pytest.raises(KeyboardInterrupt):
            token_file.write(out, SourceIds(cfg.data, tokenizer, pool, 2), made_from(cfg, tokenizer),
                             tokenizer.vocab_size, progress=progress)
        return json.loads((partial_dir(out) / token_file.PROGRESS).read_text())["at"]

    first = stopped_after(100, save_every_s=0.0)
    assert first["documents"] == 100 and not out.exists()
    second = stopped_after(400, save_every_s=3600.0)  # saved only when it stopped
    assert second["documents"] == 400 and second["doc"] > first["doc"]
    # as if killed at once: more ids on disk than the saved point, which is the first one
    progress = partial_dir(out) / token_file.PROGRESS
    progress.write_text(json.dumps({"made": json.loads(progress.read_text())["made"], "at": first}))
    assert (partial_dir(out) / TOKENS).stat().st_size > first["tokens"] * 2
    assert pretokenize(cfg, out, threads=2) == whole
    # a run over the source, at any step, goes on at the same token of the file (the streamed dataset's documents
    # counted as the file counts them)
    over_source = TokenBatches(cfg.data, tokenizer, global_batch_size=4, seq_len=63, seed=0)
    over_file = TokenBatches(compose_cfg("data=tokens", f"data.path={out}").data, tokenizer, 4, 63, 0)
    for step in range(whole["tokens"] // (4 * 64) + 2):  # into the second epoch
        assert TokenFile(str(out)).position_of(over_source.state_dict()) == over_file.state_dict(), step
        assert torch.equal(next(over_source)[0], next(over_file)[0]), step
    for name in (TOKENS, STARTS):
        assert (out / name).read_bytes() == (tmp_path / "whole.tokens" / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == [META, STARTS, TOKENS] and not partial_dir(out).exists()


def test_a_partial_write_of_another_tokenizer_is_started_over(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="membudget")
    overrides = _corpus(tmp_path)
    byte = compose_cfg(*overrides[:2])
    monkeypatch.setattr(token_file, "SAVE_EVERY_S", 0.0)

    def progress(written: int, tokens: int) -> None:
        if written == 50:
            raise KeyboardInterrupt

    tokenizer = build_tokenizer(byte.tokenizer)
    with pytest.raises(KeyboardInterrupt):
        token_file.write(tmp_path / "a.tokens", SourceIds(byte.data, tokenizer, None, 1), made_from(byte, tokenizer),
                         tokenizer.vocab_size, progress=progress)
    assert "pretokenize: stopped; the " in caplog.text and "run the same command to continue" in caplog.text
    bpe = compose_cfg(*overrides)
    pretokenize(bpe, tmp_path / "a.tokens")
    assert "starting over in" in caplog.text and "another source, tokenizer or --most-tokens" in caplog.text
    pretokenize(bpe, tmp_path / "b.tokens")
    assert (tmp_path / "a.tokens" / TOKENS).read_bytes() == (tmp_path / "b.tokens" / TOKENS).read_bytes()


def test_a_full_disk_keeps_what_was_written_and_the_same_command_continues(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="membudget")
    monkeypatch.setattr(token_file, "SAVE_EVERY_S", 0.0)  # a point saved after every document
    pretokenize(compose_cfg(), tmp_path / "fresh.tokens", most_tokens=40_000)
    with small_tmpfs(tmp_path, "256k") as disk:
        filler = disk / "filler"
        filler.write_bytes(b"x" * 200 * 1024)
        with pytest.raises(UserError) as info:
            pretokenize(compose_cfg(), disk / "docs.tokens", most_tokens=40_000)  # 80 KB and more
        message = str(info.value)
        assert "\n" not in message and "cannot write" in message and "No space left on device" in message, message
        assert f"kept in {partial_dir(disk / 'docs.tokens')}: free space and run the same command" in message
        assert not (disk / "docs.tokens").exists()
        filler.unlink()
        pretokenize(compose_cfg(), disk / "docs.tokens", most_tokens=40_000)
        continued = re.search(r"continuing an earlier write from document (\d+)", caplog.text)
        assert continued and int(continued.group(1)) > 0, caplog.text
        for name in (TOKENS, STARTS):
            assert (disk / "docs.tokens" / name).read_bytes() == (tmp_path / "fresh.tokens" / name).read_bytes()


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
    with open(out / TOKENS, "r+b") as f:
        f.truncate(2 * n)
    documents = json.loads((out / META).read_text())["source_documents"]
    with open(out / STARTS, "r+b") as f:
        f.truncate(16)
    one_line_error(f"starts.bin has 16 bytes where meta.json says {documents:,} documents of 8 bytes", TokenFile,
                   str(out))
    meta = json.loads((out / META).read_text())
    (out / META).write_text(json.dumps({**meta, "tokens": 0}))
    one_line_error("cannot read its meta.json (ValueError: 0 tokens)", TokenFile, str(out))
    (out / META).write_text("{")
    one_line_error("cannot read its meta.json", TokenFile, str(out))


def test_a_run_started_on_its_source_continues_on_its_token_file_with_the_same_losses(tmp_path, caplog):
    """The fix for a run that waits for its data, taken midway: tokenize the source once, then run the same command
    with data=tokens data.path=<file> (as a requeue would, from the last checkpoint). It continues at the
    checkpoint's token, inside a document and in a later epoch alike, with the losses of the run that stayed on the
    source (bitwise on CPU), and its later checkpoints resume on the file. A file of the source's first documents
    that the run is past is refused in one line, with the checkpoints untouched."""
    caplog.set_level(logging.INFO, logger="membudget")

    def steps(run):
        return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(run)]

    source = _corpus(tmp_path, documents=40)  # 524 tokens, 8 of them empty: an epoch every 8 steps of 66
    pretokenize(compose_cfg(*source), tmp_path / "a.tokens")
    args = (*TINY, "model.vocab_size=516", "train.steps=12", "checkpoint.every_steps=4", "checkpoint.keep=3")
    on_source = train_here(tmp_path / "source", *args, *source)
    file = [*source[2:], "data=tokens", f"data.path={tmp_path / 'a.tokens'}"]
    for last in (4, 8):  # as if the run had stopped after the checkpoint of step `last`: epoch 0, then epoch 1
        run = tmp_path / f"after{last}"
        shutil.copytree(tmp_path / "source", run)
        for step in range(last + 4, 13, 4):
            shutil.rmtree(run / "checkpoints" / f"step_{step:07d}")
        caplog.clear()
        assert train_here(run, *args, *file)["final_loss"] == on_source["final_loss"]
        assert steps(run) == steps(tmp_path / "source") and len(steps(run)) == 12
        epoch, token = divmod(last * 2 * 33, 524)
        assert re.search(rf"continuing on the token file .*a\.tokens from the checkpoint's place in what it read "
                         rf"\(epoch {epoch}, \d+ tokens into document \d+\): token {token} of epoch {epoch}",
                         caplog.text), caplog.text
        assert read_summary(run)["config"]["data"]["name"] == "tokens"
        # 8 steps of 66 tokens from token 264 read past the file's 524 (4 from token 4 of epoch 1 do not)
        assert ("holds 524 tokens, and the 8 steps to train.steps read 528" in caplog.text) == (last == 4)
    # the checkpoints written on the file resume on it as any run over a token file does, and on a copy of it
    # elsewhere (the file moved to a faster disk: the first one gone)
    run = tmp_path / "after4"
    shutil.rmtree(run / "checkpoints" / "step_0000012")
    caplog.clear()
    assert train_here(run, *args, *file)["final_loss"] == on_source["final_loss"]
    assert steps(run) == steps(tmp_path / "source") and "continuing on the token file" not in caplog.text
    shutil.rmtree(run / "checkpoints" / "step_0000012")
    (tmp_path / "a.tokens").rename(tmp_path / "moved.tokens")
    moved = [*source[2:], "data=tokens", f"data.path={tmp_path / 'moved.tokens'}"]
    assert train_here(run, *args, *moved)["final_loss"] == on_source["final_loss"]
    assert steps(run) == steps(tmp_path / "source")
    (tmp_path / "moved.tokens").rename(tmp_path / "a.tokens")
    # a file of the first documents (300 tokens): the checkpoint of step 8 over the source (epoch 1) is past them
    pretokenize(compose_cfg(*source), tmp_path / "first.tokens", most_tokens=300)
    first = [*source[2:], "data=tokens", f"data.path={tmp_path / 'first.tokens'}"]

    def refused(run, *overrides):
        before = sorted(p.relative_to(run) for p in (run / "checkpoints").rglob("*"))
        with pytest.raises(UserError) as info:
            train_here(run, *args, *overrides)
        assert sorted(p.relative_to(run) for p in (run / "checkpoints").rglob("*")) == before
        assert "\n" not in str(info.value)
        return str(info.value)

    run = tmp_path / "past"
    shutil.copytree(tmp_path / "after8", run)
    shutil.rmtree(run / "checkpoints" / "step_0000012")
    assert "--most-tokens 300), and the run is past them (epoch 1, token 4)" in refused(run, *first)
    # a run over that file goes on on the whole source's file from a checkpoint of its first pass (step 4), with
    # the source's losses; not from one after it read its documents again (step 8: what it read differs there)
    train_here(tmp_path / "first", *args, *first)
    assert steps(tmp_path / "first")[:4] == steps(tmp_path / "source")[:4]
    run = tmp_path / "grown"
    shutil.copytree(tmp_path / "first", run)
    shutil.rmtree(run / "checkpoints" / "step_0000012")
    assert f"the run has read the documents of {tmp_path / 'first.tokens'} again (epoch 1)" in refused(run, *file)
    shutil.rmtree(run / "checkpoints" / "step_0000008")
    assert train_here(run, *args, *file)["final_loss"] == on_source["final_loss"]
    assert steps(run) == steps(tmp_path / "source")


def test_a_run_that_reads_its_documents_again_says_so_by_its_step(tmp_path, caplog):
    """The data's end, reached by a small corpus or a token file of the source's first documents: said once per
    epoch, for the step that trains on it (not where batches are read ahead, past the run's last step); for a
    token file also at the start, when the run's steps will read past it."""
    source = _corpus(tmp_path, documents=40)  # 524 tokens: the batch of step 8 (66 tokens each) reads past them
    pretokenize(compose_cfg(*source), tmp_path / "a.tokens")
    tokenizer = Llama3Tokenizer(str(tmp_path / "tokenizer.model"))
    for overrides in (source[:2], ["data=tokens", f"data.path={tmp_path / 'a.tokens'}"]):
        data = compose_cfg(*overrides).data
        caplog.clear()
        batches = Prefetcher(TokenBatches(data, tokenizer, global_batch_size=2, seq_len=32, seed=0), depth=3)
        for _ in range(7):
            next(batches)  # and the three after them read ahead, into epoch 1
        assert "data: epoch" not in caplog.text
        for _ in range(9):  # to step 16: into epoch 2
            next(batches)
        batches.close()
        said = re.findall(r"data: epoch (\d) of (.+) starts by step (\d+): the run reads its documents again",
                          caplog.text)
        assert said == [("1", " ".join(overrides), "8"), ("2", " ".join(overrides), "16")], caplog.text
    file = TokenBatches(data, tokenizer, global_batch_size=2, seq_len=32, seed=0)
    assert file.rereads(7) is None  # 462 tokens of 524
    assert file.rereads(8) == (f"data.path={tmp_path / 'a.tokens'}: holds 524 tokens, and the 8 steps to "
                               f"train.steps read 528 from its token 0 of epoch 0, to epoch 1: its documents are read "
                               f"again; to read each once, write a token file of more of the source (a larger "
                               f"--most-tokens) and rerun with it before then: the run goes on on it from its "
                               f"checkpoint's token")
    file.load_state_dict({"step": 3, "epoch": 2, "doc": 0, "offset": 100})
    assert file.rereads(6) is None and "from its token 100 of epoch 2, to epoch 3" in file.rereads(7)
    assert TokenBatches(compose_cfg(*source[:2]).data, tokenizer, 2, 32, 0).rereads(100) is None  # length unknown


def test_a_token_file_that_cannot_continue_a_run_over_a_source_says_why_in_one_line(tmp_path):
    source = _corpus(tmp_path)
    pretokenize(compose_cfg(*source), tmp_path / "a.tokens", most_tokens=100)
    first = TokenFile(str(tmp_path / "a.tokens"))
    assert first.position_of({"step": 3, "epoch": 0, "doc": 2, "offset": 1}) == {
        "step": 3, "epoch": 0, "doc": 0, "offset": int(first.starts[2]) + 1}
    one_line_error(f"and the run is past them (epoch 0, token {len(first):,})", first.position_of,
                   {"step": 3, "epoch": 0, "doc": 12_345, "offset": 0})
    one_line_error("and the run is past them (epoch 1, token", first.position_of,
                   {"step": 3, "epoch": 1, "doc": 2, "offset": 1})
    one_line_error("the run is 999 tokens into document 2 of its source, where this file has", first.position_of,
                   {"step": 3, "epoch": 0, "doc": 2, "offset": 999})
    # a token file of the same source: the same token while the run read it once, past its end never
    pretokenize(compose_cfg(*source), tmp_path / "all.tokens")
    whole = TokenFile(str(tmp_path / "all.tokens"))
    assert whole.position_of({"step": 3, "epoch": 0, "doc": 0, "offset": 99}, first)["offset"] == 99
    one_line_error("the run has read the documents of", whole.position_of, {"step": 3, "epoch": 1, "doc": 0,
                                                                            "offset": 5}, first)
    one_line_error(f"and the run is past them (epoch 0, token {len(first) + 1:,})", first.position_of,
                   {"step": 3, "epoch": 0, "doc": 0, "offset": len(first) + 1}, whole)
    # a copy of the same file (moved to a faster disk, say): the same stream, in any epoch
    shutil.copytree(tmp_path / "a.tokens", tmp_path / "copy.tokens")
    at = {"step": 3, "epoch": 4, "doc": 0, "offset": 5}
    assert TokenFile(str(tmp_path / "copy.tokens")).position_of(at, first) == at
    assert whole.position_of(at, whole) == at
    # which checkpoints a run over the file goes on from, and which of another source it refuses
    fingerprint = data_fingerprint(compose_cfg("data=tokens", f"data.path={tmp_path / 'a.tokens'}").data)
    tokens = compose_cfg("data=tokens", f"data.path={tmp_path / 'all.tokens'}").data
    saved = {k: (v.value if hasattr(v, "value") else v) for k, v in compose_cfg(*source).data.items()}
    assert switch_to_token_file(saved, None, tokens, fingerprint).earlier is None
    over_first = {**saved, "name": "tokens", "path": str(tmp_path / "a.tokens")}
    assert switch_to_token_file(over_first, None, tokens, fingerprint).earlier.path == tmp_path / "a.tokens"
    assert switch_to_token_file({**over_first, "path": tokens.path}, None, tokens, fingerprint) is None  # a plain resume
    one_line_error("made from another source than the checkpoint's (data.text_field='body' there, 'text' in its "
                   "meta.json)", switch_to_token_file, {**saved, "text_field": "body"}, None, tokens, fingerprint)
    one_line_error("the checkpoint read the token file /nowhere, which says where the run stands", switch_to_token_file,
                   {**over_first, "path": "/nowhere"}, None, tokens, fingerprint)
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "a.jsonl", [{"text": "other text"}] * 3)
    pretokenize(compose_cfg("data=jsonl", f"data.path={tmp_path / 'b' / 'a.jsonl'}", *source[2:]), tmp_path / "b.tokens")
    one_line_error("made from another source than the token file", switch_to_token_file,
                   {**over_first, "path": str(tmp_path / "b.tokens")}, None, tokens, fingerprint)
    # a file of an older version, which kept no starts
    meta = json.loads((tmp_path / "a.tokens" / META).read_text())
    (tmp_path / "a.tokens" / META).write_text(json.dumps({**meta, "format": 1}))
    (tmp_path / "a.tokens" / STARTS).unlink()
    one_line_error("written by an older version, which kept no starts.bin", TokenFile(str(tmp_path / "a.tokens"))
                   .position_of, {"step": 3, "epoch": 0, "doc": 2, "offset": 1})


@pytest.mark.slow
def test_sigterm_stops_a_pretokenize_that_the_same_command_then_continues(tmp_path):
    """A SLURM time limit or scancel: SIGTERM to `python -m membudget.pretokenize` while it writes. It exits 143
    with one line that says what is kept and how to continue, and the same command writes the file one
    uninterrupted write gives."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    write_jsonl(tmp_path / "a.jsonl", [{"text": text[i:i + 2200]} for _ in range(15)
                                       for i in range(0, len(text), 2200)])  # 7 MB: a second or two to write
    overrides = ["data=jsonl", f"data.path={tmp_path / 'a.jsonl'}", "tokenizer=llama3",
                 f"tokenizer.path={write_bpe(tmp_path / 'tokenizer.model')}"]
    out = tmp_path / "a.tokens"
    proc = subprocess.Popen([sys.executable, "-m", "membudget.pretokenize", str(out), *overrides, "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    written = partial_dir(out) / TOKENS
    wait_until(lambda: written.is_file() and written.stat().st_size > 0 or proc.poll() is not None, 120,
               "the first ids on disk")
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, log
    assert re.search(r"pretokenize: stopped; the [\d,]+ tokens written by then are kept in .*\.a\.tokens\.partial: "
                     r"run the same command to continue", log), log
    assert "Traceback" not in log and not out.exists()
    pretokenize(compose_cfg(*overrides), out, threads=1)
    pretokenize(compose_cfg(*overrides), tmp_path / "fresh.tokens", threads=1)
    assert (out / TOKENS).read_bytes() == (tmp_path / "fresh.tokens" / TOKENS).read_bytes()
