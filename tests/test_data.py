"""Tokenizers, datasets and batches: CPU only, local files only (no network), a few seconds in all."""

import base64
import json
import os

import pytest
import torch
from hydra import compose, initialize_config_dir

from membudget.config import DataConfig, TokenizerConfig, UserError, register_configs
from membudget.data import (
    LLAMA3_SPECIAL_TOKENS,
    ByteTokenizer,
    TokenBatches,
    build_tokenizer,
    iter_documents,
    vocab_size_check,
)

CONF = os.path.join(os.path.dirname(__file__), "..", "conf")
MERGES = [b"th", b"he", b"the", b" t"]  # ranks 256.. after the 256 single bytes


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path, monkeypatch):
    """Hugging Face datasets writes its cache and lock files under tmp_path, not ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_bpe(path, merges=MERGES):
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
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


def test_llama3_tokenizer_on_tiny_local_model(tmp_path):
    tok = build_tokenizer(TokenizerConfig(name="tiktoken", path=write_bpe(tmp_path / "tokenizer.model")))
    n_base = 256 + len(MERGES)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (n_base + 256, n_base, n_base + 1)
    text = "the theme, then ünïcode"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert 256 + MERGES.index(b"the") in ids  # the merges are used
    assert tok.decode(ids[1:-1]) == text
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
    docs = list(iter_documents(DataConfig()))
    assert docs == [topics[k] for k in sorted(topics)]
    assert list(iter_documents(DataConfig(), start=3)) == docs[3:]


def test_text_file_directory_and_glob(tmp_path):
    corpus = write_docs(tmp_path, ["alpha", "beta"])
    (corpus / "sub").mkdir()
    (corpus / "sub" / "z.txt").write_text("gamma")
    (corpus / "notes.md").write_text("not a .txt file")
    assert list(iter_documents(DataConfig(name="text", path=str(corpus / "000_docs.txt")))) == ["alpha"]
    assert list(iter_documents(DataConfig(name="text", path=str(corpus)))) == ["alpha", "beta", "gamma"]
    assert list(iter_documents(DataConfig(name="text", path=str(corpus / "*.txt")))) == ["alpha", "beta"]
    assert list(iter_documents(DataConfig(name="text", path=str(corpus)), start=1)) == ["beta", "gamma"]


def test_jsonl_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"body": "one"}, {"body": "two", "id": 2}])
    (tmp_path / "b.jsonl").write_text('{"body": "three"}\n\n')  # blank lines are skipped
    cfg = DataConfig(name="jsonl", path=str(tmp_path), text_field="body")
    assert list(iter_documents(cfg)) == ["one", "two", "three"]
    assert list(iter_documents(cfg, start=2)) == ["three"]


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_json_builder_on_local_file(tmp_path, streaming):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    cfg = DataConfig(name="hf", hf_path="json", hf_data_files=data, streaming=streaming)
    assert list(iter_documents(cfg)) == [f"doc {i}" for i in range(4)]
    assert list(iter_documents(cfg, start=3)) == ["doc 3"]


def test_hf_without_network_is_a_user_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # What a run here sees after its retries, at once: the Hub cannot be reached.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    message = one_line_error("data.hf_path='allenai/c4'", iter_documents, DataConfig(name="hf", hf_path="allenai/c4",
                                                                                      hf_name="en"))
    assert "no network" in message and "HF_DATASETS_OFFLINE" in message


def test_dataset_errors_name_the_key(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops\n')
    write_jsonl(tmp_path / "nofield.jsonl", [{"content": "x"}])
    cases = [
        ("data.path", DataConfig(name="text", path=str(tmp_path / "missing.txt"))),
        ("data.path", DataConfig(name="text", path=None)),
        ("data.path", DataConfig(name="text", path=str(tmp_path / "empty.txt"))),
        ("data.path", DataConfig(name="text", path=str(tmp_path / "emptydir"))),
        ("data.path", DataConfig(name="text", path=str(tmp_path / "nothing*.txt"))),
        ("data.path", DataConfig(name="jsonl", path=str(tmp_path / "missing.jsonl"))),
        ("data.path", DataConfig(name="jsonl", path=str(tmp_path / "bad.jsonl"))),
        ("data.text_field", DataConfig(name="jsonl", path=str(tmp_path / "nofield.jsonl"))),
        ("data.hf_data_files", DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "none.jsonl"))),
        ("data.hf_path", DataConfig(name="hf", hf_path=None)),
        ("data.text_field", DataConfig(name="hf", hf_path="json", hf_data_files=str(tmp_path / "nofield.jsonl"))),
    ]
    for key, cfg in cases:
        message = one_line_error(key, lambda: list(iter_documents(cfg)))
        assert repr(getattr(cfg, key.split(".")[1])) in message


def test_corpus_without_any_text_is_a_user_error(tmp_path):
    data = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    batches = TokenBatches(DataConfig(name="jsonl", path=data), ByteTokenizer(), 2, 8, seed=0)
    one_line_error("data.path", next, batches)


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


@pytest.mark.parametrize("name", ["pydoc", "text", "hf", "synthetic"])
def test_resume_from_state_dict_gives_the_same_batches(tmp_path, name):
    cfg = {
        "pydoc": DataConfig(),
        "text": DataConfig(name="text", path=str(write_docs(tmp_path, ["short", "a bit longer one", "x"]))),
        "hf": DataConfig(name="hf", hf_path="json", hf_data_files=write_jsonl(
            tmp_path / "d.jsonl", [{"text": f"document {i}"} for i in range(5)])),
        "synthetic": DataConfig(name="synthetic"),
    }[name]
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


def test_synthetic_is_seeded():
    def batches(seed):
        it = TokenBatches(DataConfig(name="synthetic"), ByteTokenizer(), 4, 16, seed=seed)
        return [next(it)[0] for _ in range(2)]

    a, b, c = batches(0), batches(0), batches(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], a[1])
    assert 0 <= int(a[0].min()) and int(a[0].max()) < ByteTokenizer.vocab_size


# ----------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("option", ["data=pydoc", "data=text", "data=jsonl", "data=synthetic", "data=c4",
                                    "data=fineweb_edu", "tokenizer=byte", "tokenizer=llama3"])
def test_yaml_options_compose_against_the_schema(option):
    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        cfg = compose(overrides=["+" + option])
    group, name = option.split("=")
    node = cfg[group]
    if group == "data":
        assert node.name in ("pydoc", "text", "jsonl", "synthetic", "hf")
        if name in ("c4", "fineweb_edu"):
            assert node.hf_path in ("allenai/c4", "HuggingFaceFW/fineweb-edu") and node.hf_name
    else:
        assert node.name == {"byte": "byte", "llama3": "tiktoken"}[name]
