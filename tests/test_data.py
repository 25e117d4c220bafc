"""Tokenizers, datasets, batches and their prefetching: CPU only, local files only (no network), a few seconds."""

import base64
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import membudget.data
from membudget.data import Documents, Prefetcher, TokenBatches, unpinned_hub_data
from membudget.errors import UserError
from membudget.options import group_options
from membudget.schema import DataConfig, TokenizerConfig
from membudget.tokenizer import LLAMA3_SPECIAL_TOKENS, ByteTokenizer, Llama3Tokenizer, build_tokenizer, vocab_size_check
from tests.conftest import compose_cfg, wait_until

MERGES = [b"th", b"he", b"the", b" t"]  # ranks 256.. after the 256 single bytes


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path, monkeypatch):
    """Hugging Face datasets writes its lock files under tmp_path, not ~/.cache (without importing datasets here:
    some tests check that it is never imported)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    if sys.modules.get("datasets") is not None:
        monkeypatch.setattr(sys.modules["datasets"].config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_bpe_text(merges=MERGES) -> str:
    """A tiktoken BPE file's text: the 256 bytes, then `merges`, each with its rank."""
    tokens = [bytes([b]) for b in range(256)] + merges
    return "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))


def write_bpe(path, merges=MERGES):
    path.write_text(write_bpe_text(merges))
    return str(path)


def write_docs(tmp_path, docs, name="docs.txt"):
    """One .txt file per document under tmp_path/corpus, named so their sorted order is the list's order."""
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, doc in enumerate(docs):
        (corpus / f"{i:03d}_{name}").write_text(doc)
    return corpus


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def one_line_error(match, fn, *args, **kwargs):
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert match in message and "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------------ tokenizers

def test_byte_tokenizer_round_trip():
    tok = build_tokenizer(TokenizerConfig(name="byte"))
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert ids[0] == 256 and ids[-1] == 257 and len(ids) == len(text.encode()) + 2
    assert tok.encode(text, bos=False, eos=False) == ids[1:-1]
    assert tok.decode(ids) == text
    # the array the batches pack holds the same ids
    assert tok.encode_array(text).dtype == np.int64 and tok.encode_array(text).tolist() == ids


def test_llama3_tokenizer_on_tiny_local_model(tmp_path):
    tok = build_tokenizer(TokenizerConfig(name="tiktoken", path=write_bpe(tmp_path / "tokenizer.model")))
    n_base = 256 + len(MERGES)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n_base + 256, n_base, n_base + 1)
    text = "the theme, then ünïcode"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert 256 + MERGES.index(b"the") in ids  # the merges are used
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"
    # special-token text inside a document stays text
    assert tok.encode("<|eot_id|>", bos=False, eos=False) == list(b"<|eot_id|>")
    # a run that would overflow tiktoken's regex stack is cut into pieces
    long_run = "x" + " " * 60_000 + "the end"
    assert tok.decode(tok.encode(long_run)[1:-1]) == long_run


def test_llama3_special_tokens_match_meta():
    assert len(LLAMA3_SPECIAL_TOKENS) == len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    # ids with Meta's 128000 BPE ranks: begin 128000, end 128001, headers 128006/7, eot 128009
    index = {t: i for i, t in enumerate(LLAMA3_SPECIAL_TOKENS)}
    assert [index[t] for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                               "<|end_header_id|>", "<|eot_id|>")] == [0, 1, 6, 7, 9]
    assert LLAMA3_SPECIAL_TOKENS[-1] == "<|reserved_special_token_250|>"


def test_tokenizer_path_errors(tmp_path):
    (tmp_path / "garbage.model").write_text("not base64 !!! and no rank\n")
    for path in (None, str(tmp_path / "missing.model"), str(tmp_path / "garbage.model"), str(tmp_path)):
        one_line_error("tokenizer.path", build_tokenizer, TokenizerConfig(name="tiktoken", path=path))


def test_vocab_size_check():
    vocab_size_check(ByteTokenizer(), 258)
    one_line_error("model.vocab_size", vocab_size_check, ByteTokenizer(), 256)


# ------------------------------------------------------------------------------------------- documents

def test_pydoc_is_the_default():
    from pydoc_data.topics import topics

    assert DataConfig().name == "pydoc"
    docs = list(Documents(DataConfig()).read())
    assert docs == [topics[k] for k in sorted(topics)]
    assert list(Documents(DataConfig()).read(start=3)) == docs[3:]


def test_pydoc_and_synthetic_never_import_datasets(tmp_path, monkeypatch):
    """The default run (data=pydoc) and data=synthetic skip datasets' seconds of imports: with the module made
    unimportable, a fresh copy of membudget.data loads and both produce batches."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    spec = importlib.util.spec_from_file_location("membudget_data_copy", membudget.data.__file__)
    data = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, data)  # as an import would: its dataclasses look themselves up there
    spec.loader.exec_module(data)
    for name in ("pydoc", "synthetic"):
        batches = data.TokenBatches(DataConfig(name=name), ByteTokenizer(), 2, 16, seed=0)
        assert next(batches)[0].shape == next(batches)[0].shape == (2, 16)
    with pytest.raises(ImportError):  # the check can fail: reading files does need datasets
        list(data.Documents(DataConfig(name="text", path=str(write_docs(tmp_path, ["text"])))).read())


def test_text_file_directory_and_glob(tmp_path):
    corpus = write_docs(tmp_path, ["alpha", "beta"])
    (corpus / "sub").mkdir()
    (corpus / "sub" / "z.txt").write_text("gamma")
    (corpus / "sub" / "z[1].txt").write_text("delta")  # datasets would read "[1]" as a glob class
    (corpus / "notes.md").write_text("not a .txt file")
    assert list(Documents(DataConfig(name="text", path=str(corpus / "000_docs.txt"))).read()) == ["alpha"]
    assert list(Documents(DataConfig(name="text", path=str(corpus))).read()) == ["alpha", "beta", "gamma", "delta"]
    assert list(Documents(DataConfig(name="text", path=str(corpus / "*.txt"))).read()) == ["alpha", "beta"]
    assert list(Documents(DataConfig(name="text", path=str(corpus))).read(start=1)) == ["beta", "gamma", "delta"]
    assert list(Documents(DataConfig(name="text", path=str(corpus))).read(start=4)) == []


def test_jsonl_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"body": "one"}, {"body": "two", "id": 2}])
    # blank lines are skipped; the fields besides text_field may differ from record to record
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"body": "three"}\n\n  \n'  # a BOM, a blank line
                                       b'{"body": "caf\xe9", "meta": {"x": [1]}}\r\n')
    cfg = DataConfig(name="jsonl", path=str(tmp_path), text_field="body")
    assert list(Documents(cfg).read()) == ["one", "two", "three", "caf\ufffd"]  # bytes that are not UTF-8: U+FFFD
    assert list(Documents(cfg).read(start=2)) == ["three", "caf\ufffd"]
    assert list(Documents(cfg).read(start=4)) == []
    # streamed: nothing but lock files in datasets' cache
    assert [p.name for p in (tmp_path / "hf_cache").rglob("*") if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_json_builder_on_local_file(tmp_path, streaming):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    cfg = DataConfig(name="hf", hf_path="json", hf_data_files=data, streaming=streaming)
    assert list(Documents(cfg).read()) == [f"doc {i}" for i in range(4)]
    assert list(Documents(cfg).read(start=3)) == ["doc 3"]
    # a revision reaches load_dataset, which a builder of local files ignores
    cfg.hf_revision = "v1"
    assert list(Documents(cfg).read(start=3)) == ["doc 3"]


def test_a_hub_dataset_read_at_no_revision_is_named_with_the_fix():
    """Its files may change before a resume, and the fingerprint has none of them to compare."""
    line = unpinned_hub_data(compose_cfg("data=c4").data)
    assert line.startswith("data.hf_revision=None: data.hf_path=allenai/c4 ") and "data.hf_revision=<commit>" in line
    assert unpinned_hub_data(compose_cfg("data=c4", "data.hf_revision=1b2c3d4").data) is None
    assert unpinned_hub_data(DataConfig(name="hf", hf_path="json", hf_data_files="d.jsonl")) is None
    assert unpinned_hub_data(compose_cfg().data) is None


def test_hf_without_network_is_a_user_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # What a run here sees after its retries, at once: the Hub cannot be reached.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = one_line_error("data.hf_path='allenai/c4'", Documents, DataConfig(name="hf", hf_path="allenai/c4",
                                                                                      hf_name="en"))
    assert "no network" in message and "HF_DATASETS_OFFLINE" in message


class _HubAnswering(http.server.BaseHTTPRequestHandler):
    """A Hub that answers every request for datasets/<org>/<status>... with that HTTP status."""

    def do_GET(self):
        status = int(self.path.split("/")[3]) if self.path.startswith("/datasets/") else 404
        self.send_response(status)
        self.send_header("Retry-After", "0")  # huggingface_hub retries a 429 (five times, a second apart)
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.slow  # a fresh interpreter, and huggingface_hub's five retries of a 429, a second apart
def test_a_hub_that_refuses_is_named_with_its_status_and_the_fix(tmp_path):
    """datasets words every error of the Hub as "not found": a rate limit (HTTP 429, which a job's ranks all
    loading at once meet at scale) and a gated dataset (403) get their own cause and fix. A real HTTP server stands
    in for the Hub (HF_ENDPOINT, read when huggingface_hub is imported: a fresh process)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubAnswering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    child = ("import sys\nfrom membudget.data import Documents\nfrom membudget.errors import UserError\n"
             "from membudget.schema import DataConfig\nfor path in sys.argv[1:]:\n    try:\n"
             "        Documents(DataConfig(name='hf', hf_path=path, hf_revision='0' * 40))\n"
             "    except UserError as e:\n        print(e)\n")
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_OFFLINE": "0",
           "HF_DATASETS_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    try:
        out = subprocess.run([sys.executable, "-c", child, "org/429", "org/403"], env=env, capture_output=True,
                             text=True, timeout=120)
    finally:
        server.shutdown()
    limited, gated = out.stdout.splitlines()
    assert limited.startswith("data.hf_path='org/429': the Hub answered HTTP 429; too many requests") and \
        "shared storage and read it there (data.hf_path=json or parquet" in limited, out.stdout + out.stderr[-2000:]
    assert gated.startswith("data.hf_path='org/403': the Hub answered HTTP 403;") and "HF_TOKEN" in gated, gated


def dataset_error_cases(tmp_path):
    """(key, what the message must say, config) for every bad dataset: each fails in Documents."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n{"text": oops\n')
    write_jsonl(tmp_path / "nofield.jsonl", [{"content": "x", "id": 1}])
    (tmp_path / "later").mkdir()  # the problems are in the second file, read after the first
    write_jsonl(tmp_path / "later" / "a.jsonl", [{"text": "fine"}])
    (tmp_path / "later" / "b.jsonl").write_text('{"text": "fine"}\r\n{"text": "ok"} trailing\n')
    (tmp_path / "later_field").mkdir()
    write_jsonl(tmp_path / "later_field" / "a.jsonl", [{"text": "fine"}])
    write_jsonl(tmp_path / "later_field" / "b.jsonl", [{"text": "fine"}, {"txt": "typo"}])
    write_jsonl(tmp_path / "array.jsonl", [{"text": "fine"}, [1, 2]])
    write_jsonl(tmp_path / "number.jsonl", [{"text": 7}])
    jsonl = lambda name: DataConfig(name="jsonl", path=str(tmp_path / name))  # noqa: E731
    return [
        ("data.path", "file not found", DataConfig(name="text", path=str(tmp_path / "missing.txt"))),
        ("data.path", "local files", DataConfig(name="text", path=None)),
        ("data.path", "empty file", DataConfig(name="text", path=str(tmp_path / "empty.txt"))),
        ("data.path", "file not found", DataConfig(name="text", path=str(tmp_path / "emptydir"))),
        ("data.path", "file not found", DataConfig(name="text", path=str(tmp_path / "nothing*.txt"))),
        ("data.path", "file not found", jsonl("missing.jsonl")),
        ("data.path", f"line 3 of {tmp_path / 'bad.jsonl'} is not valid JSON", jsonl("bad.jsonl")),
        ("data.path", f"line 2 of {tmp_path / 'later' / 'b.jsonl'} is not valid JSON", jsonl("later")),
        ("data.text_field", f"line 1 of {tmp_path / 'nofield.jsonl'} has no field 'text' (it has ['content', 'id'])",
         jsonl("nofield.jsonl")),
        ("data.text_field", f"line 2 of {tmp_path / 'later_field' / 'b.jsonl'} has no field 'text' (it has ['txt'])",
         jsonl("later_field")),
        ("data.text_field", f"line 2 of {tmp_path / 'array.jsonl'} is a JSON list, not an object",
         jsonl("array.jsonl")),
        ("data.text_field", "has 'text' of type int, not a string", jsonl("number.jsonl")),
        ("data.hf_data_files", "not found",
         DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "none.jsonl"))),
        ("data.hf_path", "use data=c4 or data=fineweb_edu", DataConfig(name="hf", hf_path=None)),
        ("data.text_field", "(it has ['content', 'id'])",
         DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "nofield.jsonl"))),
        ("data.name", "choose one of data=", DataConfig(name="wikipedia")),
    ]


def test_dataset_errors_name_the_key(tmp_path):
    for key, detail, cfg in dataset_error_cases(tmp_path):
        message = one_line_error(key, lambda: list(Documents(cfg).read()))
        assert repr(getattr(cfg, key.split(".")[1])) in message and detail in message, message


def test_corpus_without_any_text_is_a_user_error(tmp_path):
    data = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    batches = TokenBatches(DataConfig(name="jsonl", path=data), ByteTokenizer(), 2, 8, seed=0)
    one_line_error("data.path", next, batches)
    (tmp_path / "lines.jsonl").write_text("\n \n")  # not empty, but no record either
    batches = TokenBatches(DataConfig(name="jsonl", path=str(tmp_path / "lines.jsonl")), ByteTokenizer(), 2, 8, 0)
    one_line_error("data.path", next, batches)


def test_every_suggested_override_composes(tmp_path, monkeypatch):
    """Each `group=option` that a data or tokenizer error message suggests is a real option: it composes."""
    import datasets
    import huggingface_hub.constants

    messages = []
    for key, _, cfg in dataset_error_cases(tmp_path):
        messages.append(one_line_error(key, lambda: list(Documents(cfg).read())))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    messages += [
        one_line_error("data.hf_path", Documents, DataConfig(name="hf", hf_path="allenai/c4", hf_name="en")),
        one_line_error("tokenizer.path", build_tokenizer, TokenizerConfig(name="tiktoken", path=None)),
        one_line_error("tokenizer.name", build_tokenizer, TokenizerConfig(name="sentencepiece")),
        one_line_error("model.vocab_size", vocab_size_check, ByteTokenizer(), 256),
        one_line_error("train.global_batch_size", TokenBatches, DataConfig(), ByteTokenizer(), 6, 16, 0, 0, 4),
    ]
    # an override is a group name (no dot: data.path=... is a key) '=' an option name
    suggested = {m for message in messages for m in re.findall(r"(?<![\w.])([a-z_]+=\w+)", message)}
    for override in sorted(suggested):
        group, option = override.split("=")
        assert option in group_options(group), f"{override} is suggested but is no option of {group}"
        compose_cfg(override)
    assert {"tokenizer=llama3", "tokenizer=byte", "data=c4", "data=fineweb_edu", "data=text", "data=jsonl",
            "data=pydoc"} <= suggested


# --------------------------------------------------------------------------------------------- batches

def packed_stream(batches, steps):
    """The stream behind `steps` batches of one rank holding the whole batch: each row's inputs + its last label."""
    rows = []
    for _ in range(steps):
        inputs, labels = next(batches)
        rows += [torch.cat([i, l[-1:]]) for i, l in zip(inputs, labels)]
    return torch.cat(rows).tolist()


def test_batches_shapes_shift_and_packing(tmp_path):
    docs = ["first doc", "second", "", "third document here"]  # the empty one adds nothing
    corpus = write_docs(tmp_path, docs)
    tok = ByteTokenizer()
    batches = TokenBatches(DataConfig(name="text", path=str(corpus)), tok, global_batch_size=4, seq_len=7, seed=0)
    inputs, labels = next(batches)
    assert inputs.shape == labels.shape == (4, 7) and inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert inputs[0, 0].item() == tok.bos_id
    # The stream is the documents' tokens back to back, looping: 3 batches of 4 x 8 tokens span 2.4 epochs.
    epoch = [t for d in docs for t in (tok.encode(d) if d else [])]
    batches = TokenBatches(DataConfig(name="text", path=str(corpus)), tok, global_batch_size=4, seq_len=7, seed=0)
    assert packed_stream(batches, 3) == (epoch * 3)[:96]
    assert batches.state_dict()["epoch"] == 2


@pytest.mark.parametrize("dp_size", [2, 4])
@pytest.mark.parametrize("name", ["pydoc", "synthetic"])
def test_global_batch_is_the_same_for_any_dp_size(name, dp_size):
    cfg, tok = DataConfig(name=name), ByteTokenizer()
    single = TokenBatches(cfg, tok, global_batch_size=8, seq_len=32, seed=1)
    ranks = [TokenBatches(cfg, tok, 8, 32, seed=1, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(3):
        inputs, labels = next(single)
        parts = [next(rank) for rank in ranks]
        assert all(p[0].shape == (8 // dp_size, 32) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), labels)


def test_global_batch_must_split_over_ranks():
    one_line_error("train.global_batch_size", TokenBatches, DataConfig(), ByteTokenizer(), 6, 16, 0, 0, 4)


def small_corpus(tmp_path, name):
    """A corpus of each kind small enough that a few batches of 3 x 6 tokens wrap around it."""
    if name == "text":
        return DataConfig(name="text", path=str(write_docs(tmp_path, ["short", "a bit longer one", "x"])))
    if name == "jsonl":
        (tmp_path / "jsonl").mkdir()
        write_jsonl(tmp_path / "jsonl" / "a.jsonl", [{"text": f"document {i}"} for i in range(2)])
        write_jsonl(tmp_path / "jsonl" / "b.jsonl", [{"text": ""}, {"text": "the last one"}])
        return DataConfig(name="jsonl", path=str(tmp_path / "jsonl"))
    if name == "hf":
        return DataConfig(name="hf", hf_path="json", hf_data_files=write_jsonl(
            tmp_path / "d.jsonl", [{"text": f"document {i}"} for i in range(5)]))
    return DataConfig(name=name)


@pytest.mark.parametrize("name", ["pydoc", "text", "jsonl", "hf", "synthetic"])
def test_resume_from_state_dict_gives_the_same_batches(tmp_path, name):
    cfg = small_corpus(tmp_path, name)
    make = lambda: TokenBatches(cfg, ByteTokenizer(), global_batch_size=3, seq_len=5, seed=7)  # noqa: E731
    first = make()
    for _ in range(5):  # the small corpora wrap around within these steps
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(4):
        a, b = next(first), next(resumed)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_streamed_hub_dataset_resumes_near_its_position_without_reading_the_stream_again(tmp_path, caplog):
    """A streamed Hugging Face dataset (data=c4, fineweb_edu, or data=hf over local files) resumes from the
    stream's own position saved with the batch position, where `skip` streamed every document before it again.
    datasets restarts a position by reading its shard from the start, and the shard before where the position
    lies in the shard's first table (a file's chunk of up to 10 MB); here, with one table per shard, breaking the
    first of five shards once the runs are built leaves every resume from the fourth unchanged: the same batches,
    at positions on the stream's batch boundaries and between them."""
    shards = tmp_path / "hub"
    shards.mkdir()
    for s in range(5):
        write_jsonl(shards / f"part{s}.jsonl", [{"text": f"s{s} d{i}"} for i in range(1000)])
    cfg = DataConfig(name="hf", hf_path="json", hf_data_files=str(shards / "*.jsonl"))
    make = lambda: TokenBatches(cfg, ByteTokenizer(), global_batch_size=2, seq_len=63, seed=0)  # noqa: E731
    first, states, batches = make(), [], []
    while len(states) < 5 or states[-5]["doc"] < 3400:  # into the fourth shard (documents 3000-3999)
        states.append(json.loads(json.dumps(first.state_dict())))  # as a checkpoint holds it
        batches.append(next(first))
    # a position the installed datasets cannot take: read from the first document instead, with a warning
    odd = make()
    odd.load_state_dict({**states[-5], "hub": {"doc": 0, "state": {"not": "a state"}}})
    assert torch.equal(next(odd)[0], batches[-5][0])
    assert any("could not resume the stream" in r.getMessage() for r in caplog.records)
    tried = [i for i, state in enumerate(states) if state["doc"] >= 3050][::4]
    assert len(tried) >= 5 and len({states[i]["hub"]["doc"] for i in tried}) >= 2
    runs = {i: make() for i in tried}  # each reads the first document as it starts (the trainer's check)
    (shards / "part0.jsonl").write_text("not json\n" * 1000)
    for i, resumed in runs.items():
        resumed.load_state_dict(states[i])
        for want in batches[i:i + 4]:
            got = next(resumed)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), i


def test_a_hub_dataset_is_loaded_once_however_often_the_batches_reread_it(tmp_path, monkeypatch):
    """Each load_dataset of a Hub dataset is requests to the Hub, from every rank of a job at once (answered with
    HTTP 429 at scale): the batches load it once, and their rereads (the trainer's rewind after checking the first
    batch, a resume, each epoch) read the loaded dataset again."""
    import datasets

    write_jsonl(tmp_path / "part0.jsonl", [{"text": f"document {i}"} for i in range(40)])
    loads = []
    load_dataset = datasets.load_dataset

    def counted(path, *args, **kwargs):
        loads.append(path)
        return load_dataset(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", counted)
    cfg = DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "*.jsonl"))
    batches = TokenBatches(cfg, ByteTokenizer(), global_batch_size=4, seq_len=31, seed=0)
    first = batches.state_dict()
    want = [next(batches) for _ in range(12)]  # 40 documents of 12 bytes (BOS/EOS included): four epochs
    assert batches.epoch >= 3
    batches.load_state_dict(first)  # the trainer's rewind
    batches.load_state_dict(json.loads(json.dumps(first)))  # a resume
    for expected in want:
        assert torch.equal(next(batches)[0], expected[0])
    assert loads == ["json"]


def test_a_downloaded_hub_dataset_reads_and_resumes_as_the_stream_does(tmp_path):
    """data.streaming=false downloads the dataset first (an Arrow cache), then reads it as the stream is read: the
    same batches, and a resume from a saved position gives the same batches in both."""
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"document {i} " * (i % 5)} for i in range(600)])
    make = lambda streaming: TokenBatches(  # noqa: E731
        DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "d.jsonl"), streaming=streaming),
        ByteTokenizer(), global_batch_size=2, seq_len=31, seed=0)
    streamed, downloaded = make(True), make(False)
    states, batches = [], []
    for _ in range(60):
        states.append(json.loads(json.dumps(downloaded.state_dict())))
        batches.append(next(downloaded))
        assert torch.equal(next(streamed)[0], batches[-1][0])
    for i in (7, 41):
        resumed = make(False)
        resumed.load_state_dict(states[i])
        for want in batches[i:i + 3]:
            assert torch.equal(next(resumed)[0], want[0]), i


def test_a_peeked_batch_is_read_once_and_handed_out_next(tmp_path, monkeypatch):
    """The trainer's check of the first batch (TokenBatches.peek): the batch is read once and is still the next
    one, with the position before it until then, where a rewind read it and opened the stream a second time."""
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"document {i}"} for i in range(400)])
    cfg = DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "d.jsonl"))
    reads = []
    read = Documents.read
    monkeypatch.setattr(Documents, "read", lambda self, *a, **k: reads.append(a or k) or read(self, *a, **k))
    plain, peeked = (TokenBatches(cfg, ByteTokenizer(), global_batch_size=2, seq_len=15, seed=0) for _ in range(2))
    start = peeked.state_dict()
    first = peeked.peek()
    assert peeked.state_dict() == start and peeked.peek() is first
    for _ in range(5):
        a, b = next(plain), next(peeked)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert peeked.state_dict() == plain.state_dict()
    assert len(reads) == 2  # each opened its stream once
    resumed = TokenBatches(cfg, ByteTokenizer(), global_batch_size=2, seq_len=15, seed=0)
    resumed.peek()
    resumed.load_state_dict(plain.state_dict())  # a resume drops the peeked batch
    assert torch.equal(next(resumed)[0], next(plain)[0])


def test_synthetic_is_seeded():
    def batches(seed):
        it = TokenBatches(DataConfig(name="synthetic"), ByteTokenizer(), 4, 16, seed=seed)
        return [next(it)[0] for _ in range(2)]

    a, b, c = batches(0), batches(0), batches(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], a[1])
    assert 0 <= int(a[0].min()) and int(a[0].max()) < ByteTokenizer.vocab_size


# ------------------------------------------------------------------------------------------- prefetching

@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetcher_hands_out_the_same_batches_and_their_position(tmp_path, depth):
    cfg = small_corpus(tmp_path, "jsonl")
    make = lambda: TokenBatches(cfg, ByteTokenizer(), global_batch_size=3, seq_len=5, seed=0)  # noqa: E731
    plain, underlying = make(), make()
    prefetcher = Prefetcher(underlying, depth)

    class Slots(threading.Semaphore):
        """The read-ahead's free slots, noting how far the thread had read when it found none and waited."""
        parked_at = None

        def acquire(self, blocking=True, timeout=None):
            if super().acquire(blocking=False):
                return True
            self.parked_at = underlying.step
            return super().acquire(blocking, timeout)

    prefetcher._free_slots = slots = Slots(depth)
    try:
        for step in range(1, 7):  # wraps the corpus twice
            a, b = next(plain), next(prefetcher)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            # the position after the last batch handed out, not after those the thread read ahead
            assert prefetcher.state_dict() == plain.state_dict() and plain.state_dict()["step"] == step
            if depth:  # exactly `depth` batches are read ahead, never more: the thread waits for a slot there
                wait_until(lambda: slots.parked_at is not None and slots.parked_at >= step + depth,
                           what="the data thread")
                assert slots.parked_at == underlying.step == step + depth
        state = json.loads(json.dumps(prefetcher.state_dict()))
    finally:
        prefetcher.close()
    resumed = make()
    resumed.load_state_dict(state)
    resumed = Prefetcher(resumed, depth)
    try:
        for _ in range(3):
            a, b = next(plain), next(resumed)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        resumed.close()


def test_prefetcher_raises_the_data_threads_error_in_order(tmp_path):
    """Bad JSON in the second file: the batches before it arrive, then the same UserError as without
    prefetching, on the same step, and again on every later call."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * 38}])
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": oops\n')
    cfg = DataConfig(name="jsonl", path=str(tmp_path))
    make = lambda: TokenBatches(cfg, ByteTokenizer(), global_batch_size=2, seq_len=7, seed=0)  # noqa: E731
    plain, prefetcher = make(), Prefetcher(make(), depth=2)
    try:
        for _ in range(2):  # 40 tokens in the first file: two batches of 16, the third needs the second file
            a, b = next(plain), next(prefetcher)
            assert torch.equal(a[0], b[0])
        expected = one_line_error(f"line 2 of {tmp_path / 'b.jsonl'} is not valid JSON", next, plain)
        for _ in range(2):
            assert one_line_error("data.path", next, prefetcher) == expected
        assert not prefetcher._thread.is_alive()
        assert prefetcher.state_dict()["step"] == 2
    finally:
        prefetcher.close()


def test_tokenizing_threads_give_the_batches_and_positions_of_one_thread(tmp_path):
    """data.tokenize_threads reads documents ahead and tokenizes them in parallel: the same batches and the same
    positions as one thread, over epochs, and resumes from any of them give the same batches. A streamed Hub
    dataset's position (the batches are behind the stream by the read-ahead, across the stream's batch boundaries)
    and a local corpus alike; a BPE tokenizer, as data.tokenize_threads=null only threads for one."""
    tokenizer = Llama3Tokenizer(write_bpe(tmp_path / "tokenizer.model"))
    write_jsonl(tmp_path / "a.jsonl", [{"text": f"the {i} th" * (i % 7)} for i in range(700)])  # empty ones too
    corpora = {"hf": DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "a.jsonl")),
               "jsonl": DataConfig(name="jsonl", path=str(tmp_path / "a.jsonl"))}
    for name, cfg in corpora.items():
        make = lambda threads: TokenBatches(cfg, tokenizer, global_batch_size=3, seq_len=47,  # noqa: E731
                                            seed=0, threads=threads)
        one, three = make(1), make(3)
        states, batches = [], []
        while len(batches) < 120:  # about 1.2 epochs
            states.append(json.loads(json.dumps(one.state_dict())))
            assert json.loads(json.dumps(three.state_dict())) == states[-1], (name, len(batches))
            batches.append(next(one))
            assert torch.equal(next(three)[0], batches[-1][0]), (name, len(batches))
        assert one.epoch == 1 and three._pool is not None
        for i in range(1, 115, 19):
            resumed = make(3)
            resumed.load_state_dict(states[i])
            for want in batches[i:i + 5]:
                assert torch.equal(next(resumed)[0], want[0]), (name, i)
            resumed.close()
        three.close()


def test_tokenize_threads_default_to_the_ranks_share_of_its_cpus_for_a_bpe_tokenizer():
    from membudget.data import TOKENIZE_THREADS_MOST, tokenize_threads

    bpe, byte = TokenizerConfig(name="tiktoken"), TokenizerConfig()
    cpus = len(os.sched_getaffinity(0))
    assert tokenize_threads(DataConfig(), bpe, 1) == max(1, min(TOKENIZE_THREADS_MOST, cpus))
    assert tokenize_threads(DataConfig(), bpe, 4 * cpus) == 1  # more ranks on the node than CPUs: one each
    assert tokenize_threads(DataConfig(), byte, 1) == 1  # numpy outruns threads
    assert tokenize_threads(DataConfig(name="synthetic"), bpe, 1) == 1
    assert tokenize_threads(DataConfig(tokenize_threads=5), byte, 8) == 5  # the user's word


def test_a_document_that_cannot_be_read_is_raised_at_its_turn_with_tokenizing_threads(tmp_path):
    """Bad JSON read ahead by the tokenizing threads: the batches before it arrive, then the error one thread
    raises, on the same step."""
    tokenizer = Llama3Tokenizer(write_bpe(tmp_path / "tokenizer.model"))
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * 38}])
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": oops\n')
    cfg = DataConfig(name="jsonl", path=str(tmp_path))
    one, four = (TokenBatches(cfg, tokenizer, global_batch_size=2, seq_len=7, seed=0, threads=n) for n in (1, 4))
    for _ in range(2):
        assert torch.equal(next(one)[0], next(four)[0])
    assert one_line_error("data.path", next, four) == one_line_error("data.path", next, one)
    four.close()


def test_prefetcher_close_stops_the_thread():
    prefetcher = Prefetcher(TokenBatches(DataConfig(), ByteTokenizer(), 2, 16, seed=0), depth=2)
    prefetcher.close()  # before any batch: nothing to stop
    assert prefetcher._thread is None
    prefetcher = Prefetcher(TokenBatches(DataConfig(), ByteTokenizer(), 2, 16, seed=0), depth=2)
    next(prefetcher)
    # the read-ahead is full: the thread waits for a free slot
    wait_until(lambda: prefetcher.batches.step == 3, what="the data thread")
    thread = prefetcher._thread
    assert thread.is_alive()
    prefetcher.close()  # joins for at most 10 s: a thread still waiting for a slot would still be alive
    assert not thread.is_alive()


def test_the_data_fingerprint_sees_what_a_resume_or_another_node_would_read_differently(tmp_path):
    """Names relative to the files' common dir and sizes of every file, content sampled: equal for a copy
    elsewhere; each kind of change named, file by file."""
    from membudget.data import FINGERPRINT_CHUNK, FINGERPRINT_CHUNKS, FINGERPRINT_FILES, data_changes, data_fingerprint

    def text(path):
        return data_fingerprint(DataConfig(name="text", path=str(path)))

    corpus = write_docs(tmp_path, ["alpha", "beta"])
    (corpus / "big.txt").write_bytes(b"x" * (3 * FINGERPRINT_CHUNKS * FINGERPRINT_CHUNK))  # sampled, not read whole
    before = text(corpus)
    assert sorted(before["files"]) == ["000_docs.txt", "001_docs.txt", "big.txt"]
    copy = tmp_path / "b"
    copy.mkdir()
    for f in corpus.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert text(copy) == before and data_changes(before, text(copy)) == []

    def changed(edit):
        for f in copy.iterdir():
            f.unlink()
        for f in corpus.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        edit()
        return data_changes(before, text(copy))

    assert changed(lambda: (copy / "001_docs.txt").write_text("beta!")) == ["001_docs.txt is 4 bytes then and 5 now"]
    assert changed(lambda: (copy / "001_docs.txt").write_text("BETA")) == [
        "001_docs.txt has other content (the same 4 bytes)"]
    assert changed(lambda: (copy / "000_docs.txt").unlink()) == ["000_docs.txt only then"]
    assert changed(lambda: (copy / "0000.txt").write_text("new")) == ["0000.txt only now"]
    first_chunk = b"y" + b"x" * (3 * FINGERPRINT_CHUNKS * FINGERPRINT_CHUNK - 1)  # an edit in a sampled chunk
    assert changed(lambda: (copy / "big.txt").write_bytes(first_chunk)) == [
        f"big.txt has other content (the same {len(first_chunk):,} bytes)"]
    # one file: its name alone; jsonl alike; synthetic data and the Hub read no files
    assert list(text(corpus / "big.txt")["files"]) == ["big.txt"]
    write_jsonl(tmp_path / "j.jsonl", [{"text": "one"}])
    assert list(data_fingerprint(DataConfig(name="jsonl", path=str(tmp_path / "j.jsonl")))["files"]) == ["j.jsonl"]
    assert data_fingerprint(DataConfig(name="synthetic")) == {} == data_fingerprint(DataConfig(name="hf", hf_path="c4"))
    # a tiktoken file, read whole; a copy elsewhere is equal; a checkpoint from before tokenizers has none
    tokens = data_fingerprint(DataConfig(name="synthetic"), TokenizerConfig(name="tiktoken",
                                                                              path=write_bpe(tmp_path / "a.model")))
    assert data_changes(tokens, data_fingerprint(DataConfig(name="synthetic"), TokenizerConfig(
        name="tiktoken", path=write_bpe(copy / "tokenizer.model")))) == [] == data_changes({}, tokens)
    assert data_changes(tokens, data_fingerprint(DataConfig(name="synthetic"), TokenizerConfig(
        name="tiktoken", path=write_bpe(copy / "b.model", MERGES[:-1]))), then="on rank 0", now="on rank 1") == [
        f"the tokenizer file a.model is {len(write_bpe_text()):,} bytes on rank 0 and b.model "
        f"{len(write_bpe_text(MERGES[:-1])):,} on rank 1"]
    assert data_changes(tokens, data_fingerprint(DataConfig(name="synthetic"), TokenizerConfig(
        name="tiktoken", path=str(copy / "gone.model")))) == ["the tokenizer file gone.model is missing now"]
    assert data_fingerprint(DataConfig(name="synthetic"), TokenizerConfig()) == {}  # the byte tokenizer: no file
    pydoc = data_fingerprint(DataConfig(name="pydoc"))
    assert data_changes(pydoc, {"pydoc": "other"}) == ["CPython's pydoc topics differ (another Python version now "
                                                       "than then?)"]
    # many files: every size, the content of FINGERPRINT_FILES of them
    many = tmp_path / "many"
    many.mkdir()
    for i in range(FINGERPRINT_FILES + 10):
        (many / f"{i:03d}.txt").write_text(f"doc {i}")
    digests = [d for _, d in text(many)["files"].values()]
    assert sum(d is not None for d in digests) == FINGERPRINT_FILES and digests[0] and digests[-1]
    listed = data_changes(text(many), text(corpus), then="on rank 0", now="on rank 1")
    assert listed[:1] == ["000.txt only on rank 0"] and listed[-1] == f"and {FINGERPRINT_FILES + 10} more files"
