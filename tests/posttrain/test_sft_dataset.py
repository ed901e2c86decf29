"""SFT datasets end to end: packed rows against each conversation run alone through a tiny model,
the seed and the split, context parallelism, truncation, and `tessera preprocess --sft` against
reading the JSONL itself.

Tolerance of the model comparison, fp32 on CPU: a conversation alone and inside a packed row
go through the same per-document SDPA over the same tokens; only the order of additions in
the kernels may differ, a few ulps: rtol 1e-5.
"""

import json
import random

import pytest
import torch

from tessera.cli.preprocess import main as preprocess_main
from tessera.config import ConfigError, DataConfig, ModelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.data.indexed import IndexedDataset
from tessera.data.loader import collate_micro_batch
from tessera.models.documents import Documents
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.posttrain.sft_data import build_chat_tokenizer, row_conversations, tokenize_conversation
from tessera.posttrain.sft_dataset import build_sft_datasets
from tessera.posttrain.sft_preprocess import preprocess_sft, sft_prefix
from tests.posttrain.test_sft_data import make_hf_tokenizer

IDENTITY = PostTrainConfig(sft=True, sft_tokenizer_prompt_format="identity")
WORDS = "hello world how are you I am fine thank you what is the weather sunny".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat_rows(count: int, seed: int = 0) -> list[dict]:
    """Rows of one or two conversations (a system message opens the second), or prompt/completion."""
    rng, rows = random.Random(seed), []
    for i in range(count):
        if i % 4 == 3:
            rows.append({"prompt": text(rng, 2), "completion": text(rng, rng.randint(1, 4))})
            continue
        messages = []
        for _ in range(1 + (i % 3 == 0)):
            messages += [{"role": "system", "content": text(rng, 1)}, {"role": "user", "content": text(rng, 2)},
                         {"role": "assistant", "content": text(rng, rng.randint(1, 5))}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def byte_data(path, **flags) -> DataConfig:
    return DataConfig(tokenizer_type="ByteTokenizer", **{"data_path": [path], "split": "1", **flags})


def build(data, posttrain=IDENTITY, *, seq_length=64, seed=1, train=8, valid=0):
    return build_sft_datasets(data, posttrain, seq_length=seq_length, seed=seed, train_samples=train,
                              valid_samples=valid)


def samples_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def row_conversations_of(dataset, index):
    """(ids, mask) of the conversations packed in sample `index`, in the row's order."""
    starts, items = dataset.index["row_starts"], dataset.index["row_items"]
    row = int(dataset.index["order"][index])
    return [dataset.conversation(int(i)) for i in items[starts[row]:starts[row + 1]]]


def test_packed_rows_give_each_conversation_the_losses_it_has_alone(tmp_path):
    seq_length = 64
    train, _ = build(byte_data(write_jsonl(tmp_path / "chats.jsonl", chat_rows(12))))
    batch = collate_micro_batch([train[0], train[1]])
    config = ModelConfig(**{**PRESETS["tiny-llama"], "vocab_size": 264, "seq_length": seq_length,
                            "hidden_dropout": 0.0, "attention_dropout": 0.0})
    model = GPTModel(config)
    initialize_parameters(model, seed=3)
    documents = Documents.from_cu_seqlens(batch["cu_seqlens"], 2, seq_length, backend="per_document",
                                          device=torch.device("cpu"))
    with torch.no_grad():
        packed = model(batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"],
                       documents=documents)
        unseparated = model(batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"])
        checked = 0
        for row in range(2):
            start = 0
            for ids, mask in row_conversations_of(train, row):
                ids = torch.as_tensor(ids, dtype=torch.long)
                alone = model(ids[None, :-1], labels=ids[None, 1:])[0]
                end = start + len(ids) - 1
                torch.testing.assert_close(packed[row, start:end], alone, rtol=1e-5, atol=0)
                assert batch["loss_mask"][row, start:end].tolist() == mask[1:].tolist()
                if start > 0:   # the test can fail: without documents a later conversation sees the earlier
                    assert not torch.allclose(unseparated[row, start:end], alone, rtol=1e-3)
                    checked += 1
                start = end + 1
    assert checked > 0


def test_the_order_is_the_seeds_and_the_packing_the_lengths_alone(tmp_path):
    data = byte_data(write_jsonl(tmp_path / "chats.jsonl", chat_rows(24)))
    first, again, other = build(data, train=30)[0], build(data, train=30)[0], build(data, train=30, seed=2)[0]
    rows = first.num_rows
    assert len(first) == 30 > 2 * rows   # three epochs
    assert all(samples_equal(first[i], again[i]) for i in range(len(first)))
    assert [int(r) for r in first.index["order"][:30]] != [int(r) for r in other.index["order"][:30]]
    assert first.index["row_items"].tolist() == other.index["row_items"].tolist()
    for epoch in range(2):   # every epoch serves every row once
        assert sorted(first.index["order"][epoch * rows:(epoch + 1) * rows].tolist()) == list(range(rows))


def test_split_cuts_the_conversations_into_train_then_valid(tmp_path):
    rows = chat_rows(20)
    data = byte_data(write_jsonl(tmp_path / "chats.jsonl", rows), split="3,1")
    train, valid = build(data, train=4, valid=4)
    tokenizer = build_chat_tokenizer(data, "identity")
    conversations = [tuple(tokenize_conversation(c, tokenizer, "identity")[0].tolist())
                     for row in rows for c in row_conversations(row)]
    boundary = round(0.75 * len(conversations))

    def held(dataset):
        return sorted(tuple(dataset.conversation(int(i))[0].tolist()) for i in dataset.index["row_items"])

    assert held(train) == sorted(conversations[:boundary]) and held(valid) == sorted(conversations[boundary:])


def test_too_long_conversations_are_cut_and_dropped_when_no_answer_is_left(tmp_path):
    long_prompt = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "late answer"}]
    long_answer = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y" * 40}]
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [{"messages": messages} for messages in (long_prompt, long_answer, short)]
    data = byte_data(write_jsonl(tmp_path / "chats.jsonl", rows))
    with pytest.warns(UserWarning, match="2 of 3 train conversations are longer than a row .33 tokens. and were cut "
                                         "on the right; 1 of them kept no assistant token and were dropped"):
        train, _ = build(data, seq_length=32, train=2)
    kept = sorted(len(train.conversation(int(i))[0]) for i in train.index["row_items"])
    assert kept == [2 + 1, 1 + 40 + 1]   # the short one and the cut one; not the long prompt


@pytest.mark.parametrize("flags, message", [
    (dict(reset_attention_mask=True), "drop --reset-attention-mask"),
    (dict(data_path=["0.5", "a.jsonl", "0.5", "b.jsonl"]), "give paths without blend weights"),
    (dict(data_path=["missing.jsonl"]), "--data-path missing.jsonl: no such file"),
    (dict(data_path=["missing_prefix"]), "--data-path missing_prefix: .*missing_prefix.idx: no such file"),
], ids=["reset attention mask", "weights", "no file", "no prefix"])
def test_bad_data_flags_are_one_line(tmp_path, flags, message):
    data = byte_data(write_jsonl(tmp_path / "chats.jsonl", chat_rows(4)), **flags)
    with pytest.raises(ConfigError, match=message):
        build(data)


def test_preprocessed_conversations_train_as_the_jsonl_does(tmp_path, capsys):
    data = make_hf_tokenizer(tmp_path / "tokenizer")
    path = write_jsonl(tmp_path / "chats.jsonl", chat_rows(30))
    posttrain = PostTrainConfig(sft=True)
    summary = preprocess_sft([path], str(tmp_path / "out"), data, "default", workers=2, block_bytes=512)
    prefix = sft_prefix(str(tmp_path / "out"))
    assert summary.documents == 30 and IndexedDataset(prefix).num_documents == 30
    for source in (path, prefix):
        data.data_path, data.split = [source], "7,3"
        built = build(data, posttrain, train=12, valid=5)
        if source == path:
            from_jsonl = built
    assert None not in from_jsonl + built
    for direct, preprocessed in zip(from_jsonl, built):
        assert len(direct) == len(preprocessed)
        assert all(samples_equal(direct[i], preprocessed[i]) for i in range(len(direct)))
    # The CLI: the summary names the --data-path; a bad row is one line, exit 2.
    flags = ["--workers", "1", "--sft", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             data.tokenizer_model]
    assert preprocess_main(["--input", path, "--output-prefix", str(tmp_path / "cli"), *flags]) == 0
    assert f"--data-path {sft_prefix(str(tmp_path / 'cli'))}" in capsys.readouterr().out
    bad = write_jsonl(tmp_path / "bad.jsonl", chat_rows(2) + [{"messages": [{"role": "bot", "content": "x"}]}])
    for extra in ([], ["--append-eod"]):
        with pytest.raises(SystemExit) as exit_:
            preprocess_main(["--input", bad, "--output-prefix", str(tmp_path / "bad"), *flags, *extra])
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and error.count("\n") == 1
        assert (f"{bad}:3: message 1: unknown role 'bot'" if not extra else "--sft takes conversations, not "
                "--append-eod") in error
