"""Attention within packed documents: each kernel against an explicit masked softmax, document
isolation in a whole model, recompute, and packed-document training against the dense mask.

Tolerance, fp32 on CPU: the kernels and the oracle add the same products in another order
(per-document or fused softmax), a few ulps: rtol 1e-5 element-wise for attention outputs
and losses; gradients and parameters by ||a - b|| / ||b|| <= 1e-5, since a near-zero
element's relative rounding says nothing of the kernel (tests/dist/equivalence.py).
Isolation is exact: a token never reads another document, so its results are bitwise the
same whatever that document holds.
"""

import json
import warnings

import numpy as np
import pytest
import torch

from tests.conftest import TINY, run_config
from tessera.config import ModelConfig
from tessera.models.documents import Documents, default_backend
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.perf.flops import flops_per_iteration
from tessera.training.trainer import Trainer

CPU = torch.device("cpu")
SEQ = 24
# Three samples: short and one-token documents, one document filling its sample, two halves.
LENGTHS = [[5, 1, 12, 6], [SEQ], [3, 21]]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def cu_seqlens(lengths_per_sample=LENGTHS, seq=SEQ) -> torch.Tensor:
    bounds = [0]
    for row, lengths in enumerate(lengths_per_sample):
        assert sum(lengths) == seq
        bounds += [row * seq + int(n) for n in np.cumsum(lengths)]
    return torch.tensor(bounds, dtype=torch.int32)


def documents(backend: str, lengths=LENGTHS, seq=SEQ) -> Documents:
    return Documents.from_cu_seqlens(cu_seqlens(lengths, seq), len(lengths), seq, backend=backend, device=CPU)


def masked_softmax_attention(q, k, v, lengths, scale):
    """The oracle: scores for every pair, -inf outside the query's document or in its future (fp64)."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    position = torch.arange(q.shape[2])
    allowed = (ids[:, :, None] == ids[:, None, :]) & (position[:, None] >= position[None, :])
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1) @ v


def qkv(seed=0, batch=len(LENGTHS), heads=4, groups=2, dim=16, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, SEQ, dim, generator=g, requires_grad=grad) for n in (heads, groups, groups)]


@pytest.mark.parametrize("backend", ["per_document", "dense"])
def test_kernel_matches_masked_softmax_with_gradients(backend):
    q, k, v = qkv()
    weights = torch.randn(len(LENGTHS), 4, SEQ, 16, generator=torch.Generator().manual_seed(1))
    expected = masked_softmax_attention(q, k, v, LENGTHS, 0.3)
    (expected * weights).sum().backward()
    expected_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = documents(backend).attend(q, k, v, enable_gqa=True, scale=0.3)
    (out * weights).sum().backward()
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-6)
    for name, t, grad in zip("qkv", (q, k, v), expected_grads):
        torch.testing.assert_close(t.grad, grad.float(), rtol=1e-5, atol=1e-6, msg=lambda m: f"d{name}: {m}")


def test_flex_kernel_matches_masked_softmax():
    # FlexAttention has no backward on CPU: its gradients are checked in tests/gpu.
    q, k, v = qkv(grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": the unfused reference path
        out = documents("flex").attend(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, masked_softmax_attention(q, k, v, LENGTHS, 16 ** -0.5).float(),
                               rtol=1e-5, atol=1e-6)


def test_bad_documents_are_refused():
    with pytest.raises(ValueError, match="--reset-attention-mask"):  # a document across two samples
        Documents.from_cu_seqlens(torch.tensor([0, 20, 48]), 2, SEQ, backend="per_document", device=CPU)
    with pytest.raises(ValueError, match="--reset-attention-mask"):  # an empty document
        Documents.from_cu_seqlens(torch.tensor([0, 5, 5, 24]), 1, SEQ, backend="per_document", device=CPU)
    with pytest.raises(ValueError, match="backend 'sliding'"):
        Documents.from_cu_seqlens(cu_seqlens(), 3, SEQ, backend="sliding", device=CPU)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="--attention-dropout"):
        documents("flex").attend(q, k, v, dropout_p=0.1, enable_gqa=True)


def test_default_backend_follows_device_dtype_and_dropout():
    assert default_backend(CPU, torch.bfloat16, dropout=False) == "per_document"
    cuda = torch.device("cuda")
    assert default_backend(cuda, torch.bfloat16, dropout=True) == "per_document"   # only SDPA has dropout
    assert default_backend(cuda, torch.float32, dropout=False) == "flex"           # FlashAttention: half only
    assert default_backend(cuda, torch.bfloat16, dropout=False) in ("varlen", "flex")


# -- a whole model ---------------------------------------------------------------------

def tiny_llama() -> ModelConfig:
    return ModelConfig(**{**PRESETS["tiny-llama"], "seq_length": SEQ, "hidden_dropout": 0.0,
                          "attention_dropout": 0.0})


def model_loss_and_grads(config, tokens, docs, recompute=Recompute(), mask=None):
    """Per-token loss, and the gradients of its (masked) sum with respect to every parameter."""
    model = GPTModel(config, recompute=recompute)
    initialize_parameters(model, seed=3)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS]).view(len(LENGTHS), SEQ)
    loss = model(tokens, labels=torch.roll(tokens, -1, dims=1), position_ids=positions, documents=docs)
    (loss if mask is None else loss * mask).sum().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def random_tokens(seed=4):
    return torch.randint(0, 256, (len(LENGTHS), SEQ), generator=torch.Generator().manual_seed(seed))


def test_changing_one_document_changes_nothing_in_another():
    """Document i (row 0, tokens 6-17) keeps its losses and its loss's gradients, bitwise, when
    document j changes: the one before it in its own sample (causality alone would not protect
    it) and one in another sample."""
    config = tiny_llama()
    i = torch.zeros(len(LENGTHS), SEQ)
    i[0, 6:18] = 1
    tokens = random_tokens()
    changed = tokens.clone()
    changed[0, :5] = (changed[0, :5] + 1) % 256      # document 0 of row 0
    changed[2, 3:] = (changed[2, 3:] + 7) % 256      # the second document of row 2
    docs = documents("per_document")
    loss, grads = model_loss_and_grads(config, tokens, docs, mask=i)
    changed_loss, changed_grads = model_loss_and_grads(config, changed, docs, mask=i)
    assert torch.equal(loss[i.bool()], changed_loss[i.bool()])
    assert not torch.equal(loss[0, :5], changed_loss[0, :5])   # the test can fail: the change is seen
    for name, grad in grads.items():
        assert torch.equal(grad, changed_grads[name]), name
    # Without documents the same change does reach document i.
    plain, _ = model_loss_and_grads(config, tokens, None, mask=i)
    plain_changed, _ = model_loss_and_grads(config, changed, None, mask=i)
    assert not torch.equal(plain[i.bool()], plain_changed[i.bool()])


@pytest.mark.parametrize("recompute", [Recompute("selective"), Recompute("full", "uniform", 1)],
                         ids=["selective", "full"])
def test_recompute_with_documents_matches_the_dense_mask(recompute):
    config = tiny_llama()
    tokens = random_tokens()
    expected_loss, expected_grads = model_loss_and_grads(config, tokens, documents("dense"))
    loss, grads = model_loss_and_grads(config, tokens, documents("per_document"), recompute=recompute)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) <= 1e-5, name


# -- training on packed documents ------------------------------------------------------

def packed_corpus(tmp_path) -> list[str]:
    """Flags for a byte-level corpus of documents of mixed lengths (2 to 60 bytes), EOD-terminated."""
    from tessera.config import DataConfig
    from tessera.data.preprocess import preprocess

    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "".join(rng.choice(list("abcdefgh "), rng.integers(1, 60)))}) for _ in range(80)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    preprocess([str(tmp_path / "corpus.jsonl")], str(tmp_path / "corpus"), DataConfig(tokenizer_type="ByteTokenizer"),
               append_eod=True)
    return ["--data-path", str(tmp_path / "corpus_text_document"), "--split", "1,0,0", "--tokenizer-type",
            "ByteTokenizer", "--data-cache-path", str(tmp_path / "cache"), "--vocab-size", "257",
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_packed_training_matches_the_dense_mask_and_counts_document_flops(tmp_path):
    flags = packed_corpus(tmp_path) + ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
                                       "--log-interval", "1", "--log-json", str(tmp_path / "log.jsonl")]
    runs = {}
    for backend in ("dense", "per_document"):
        trainer = Trainer(run_config(*flags, base=[f for f in TINY if f != "--mock-data"]))
        assert trainer.document_backend == "per_document"   # the CPU default
        trainer.document_backend = backend
        runs[backend] = ([r.loss for r in trainer.train()], dict(trainer.model.named_parameters()))
    torch.testing.assert_close(runs["per_document"][0], runs["dense"][0], rtol=1e-5, atol=0)
    for name, param in runs["per_document"][1].items():
        assert relative_error(param, runs["dense"][1][name]) <= 1e-5, name

    # MFU counts attention on each document's own length: sum of n^2 over the step's documents,
    # read here from the EOD tokens of the samples each iteration consumed.
    dataset, config = trainer.data.datasets["train"], trainer.config
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()][-3:]
    for iteration, record in enumerate(records):
        squares = 0
        for index in range(iteration * 4, iteration * 4 + 4):   # global batch 4
            eod = np.flatnonzero(dataset[index]["tokens"].numpy()[:-1] == 256) + 1
            squares += int((np.diff([0, *eod, config.model.seq_length]) ** 2).sum())
        expected = flops_per_iteration(config.model, 4, vocab_size=trainer.model.vocab_size,
                                       squared_document_lengths=squares)
        logged = record["tflops_per_gpu"] * 1e12 * record["iteration_time_ms"] / 1e3
        assert logged == pytest.approx(expected, rel=1e-6)
        assert squares < 4 * config.model.seq_length ** 2   # fewer than the whole-sequence count
