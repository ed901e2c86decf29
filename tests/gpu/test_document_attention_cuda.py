"""The packed-document kernels on CUDA (varlen, compiled flex) against the dense mask, and a
compiled block fed micro-batches of different document layouts. Run on a GPU machine:
`python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models.documents import Documents, default_backend
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import PRESETS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
BATCH, SEQ, HEADS, GROUPS, DIM = 2, 512, 8, 2, 64


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _documents(backend: str, seed: int = 0) -> Documents:
    """Random documents of 1 to 300 tokens, cut at each sample's end."""
    g = torch.Generator().manual_seed(seed)
    bounds = {0}
    for row in range(BATCH):
        start = row * SEQ
        while start < (row + 1) * SEQ:
            start = min(start + int(torch.randint(1, 300, (1,), generator=g)), (row + 1) * SEQ)
            bounds.add(start)
    cu = torch.tensor(sorted(bounds), dtype=torch.int32)
    return Documents.from_cu_seqlens(cu, BATCH, SEQ, backend=backend, device=CUDA)


def _attention(backend: str, dtype: torch.dtype):
    g = torch.Generator("cuda").manual_seed(1)
    q, k, v = (torch.randn(BATCH, n, SEQ, DIM, device=CUDA, dtype=dtype, generator=g).requires_grad_()
               for n in (HEADS, GROUPS, GROUPS))
    out = _documents(backend).attend(q, k, v, enable_gqa=True)
    out.backward(torch.randn(out.shape, device=CUDA, dtype=dtype, generator=g))
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("backend, dtype, tolerance", [
    ("varlen", torch.bfloat16, 1e-2), ("flex", torch.bfloat16, 1e-2), ("flex", torch.float32, 1e-5),
    ("per_document", torch.bfloat16, 1e-2)])
def test_kernel_matches_the_dense_mask(backend, dtype, tolerance):
    if backend == "varlen" and default_backend(CUDA, torch.bfloat16, dropout=False) != "varlen":
        pytest.skip("this torch has no torch.nn.attention.varlen")
    expected = _attention("dense", torch.float32)   # the fp32 dense mask: the oracle
    for name, actual, reference in zip(["out", "dq", "dk", "dv"], _attention(backend, dtype), expected):
        assert _error(actual, reference) < tolerance, f"{backend} {dtype} {name}"


@pytest.mark.parametrize("backend", ["varlen", "flex", "per_document"])
def test_compiled_model_trains_on_changing_document_layouts(backend):
    if backend == "varlen" and default_backend(CUDA, torch.bfloat16, dropout=False) != "varlen":
        pytest.skip("this torch has no torch.nn.attention.varlen")
    config = ModelConfig(**{**PRESETS["tiny-llama"], "seq_length": SEQ, "max_position_embeddings": SEQ})
    with torch.device(CUDA):
        model, eager = GPTModel(config), GPTModel(config)
    for m in (model, eager):
        initialize_parameters(m, seed=2)
    for layer in model.layers:
        layer.compile()
    tokens = torch.randint(0, 256, (BATCH, SEQ), device=CUDA)
    for seed in range(5):   # a new layout every micro-batch, as in training
        losses = []
        # The first two layouts may compile (a changed max_seqlen turns dynamic); later ones must not.
        with torch._dynamo.config.patch(error_on_recompile=seed >= 2):
            for m in (model, eager):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(tokens, labels=tokens.roll(-1, 1), documents=_documents(backend, seed)).mean()
                loss.backward()
                losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-2), f"layout {seed}"
