"""The decode step's Triton kernels against plain PyTorch: paged decode attention (tessera.kernels.
paged_decode) against softmax attention over the gathered context, the one-row GEMV (tessera.kernels.
gemv) against F.linear, the fused single-request step (tessera.inference.fused_decode) against the
model's forward, and the CUDA engine that uses them all against the same model's engine on the CPU.
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.inference import fused_decode
from tessera.inference.engine import Engine
from tessera.inference.kv_cache import PagedKVCache
from tessera.inference.paged_attention import StepAttention
from tessera.inference.runner import forward_tokens
from tessera.inference.sampling import SamplingParams
from tessera.kernels import argmax, gemv, paged_decode
from tessera.models.gpt import GPTModel, initialize_parameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or paged_decode.triton is None,
                                reason="needs a CUDA device and Triton")


def _reference_attention(q, key_pool, value_pool, tables, lengths, block_size, scale):
    rows, heads, dim = q.shape
    groups = key_pool.shape[1]
    out = []
    for row in range(rows):
        position = torch.arange(int(lengths[row]), device=q.device)
        slots = tables[row][position // block_size] * block_size + position % block_size
        keys = key_pool[slots].transpose(0, 1).double()        # [groups, length, d]
        values = value_pool[slots].transpose(0, 1).double()
        queries = q[row].double().view(groups, heads // groups, dim)
        probs = (queries @ keys.transpose(1, 2) * scale).softmax(-1)
        out.append((probs @ values).reshape(heads, -1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, groups, dim, dim_v, block_size, width", [
    (1, 16, 4, 128, 128, 16, 32),     # config B at batch 1
    (32, 16, 4, 128, 128, 16, 16),    # config B at batch 32
    (3, 8, 8, 64, 64, 16, 5),         # multi-head (a group of one)
    (2, 12, 1, 96, 80, 32, 7),        # multi-query, head dims not powers of two, other block size
])
def test_paged_decode_attention_equals_softmax_attention(dtype, rows, heads, groups, dim, dim_v, block_size, width):
    generator = torch.Generator(device="cuda").manual_seed(rows * 1000 + dim)
    num_blocks = 4 * width + 1
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=generator).to(dtype)  # noqa: E731
    key_pool, value_pool = randn(num_blocks * block_size, groups, dim), randn(num_blocks * block_size, groups, dim_v)
    tables = torch.stack([torch.randperm(num_blocks - 1, device="cuda", generator=generator)[:width] + 1
                          for _ in range(rows)])
    lengths = torch.randint(1, width * block_size + 1, (rows,), device="cuda", generator=generator)
    lengths[0] = 1                        # a context of only the new token
    lengths[-1] = width * block_size      # a full table
    q = randn(rows, heads, dim)
    out = paged_decode.paged_decode_attention(q, key_pool, value_pool, tables, lengths - 1, block_size, dim ** -0.5)
    expected = _reference_attention(q, key_pool, value_pool, tables, lengths, block_size, dim ** -0.5)
    # fp32: the order of summation only; bf16: the probabilities are rounded to bf16 before the values' product
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 5632), (1000, 136), (7, 4096)])
def test_gemv_equals_f_linear(dtype, n, k):
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", generator=generator).to(dtype)
    x = torch.randn(1, 1, k, device="cuda", generator=generator).to(dtype)
    bias = torch.randn(n, device="cuda", generator=generator).to(dtype)
    with torch.no_grad():
        y = gemv.linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert y.shape == (1, 1, n) and y.dtype == dtype
    scale = expected.abs().max().item()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.double() - expected).abs().max().item() <= tolerance * scale


def test_gemv_is_not_used_where_autograd_needs_the_product():
    weight = torch.randn(64, 32, device="cuda", requires_grad=True)
    x = torch.randn(1, 32, device="cuda")
    gemv.linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.expand(64, 32))


CONFIG = dict(num_layers=2, hidden_size=128, num_attention_heads=8, group_query_attention=True, num_query_groups=2,
              ffn_hidden_size=256, seq_length=512, vocab_size=512, position_embedding_type="rope",
              normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
              init_method_std=0.1)


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled-graphs"])
def test_cuda_engine_with_the_kernels_equals_the_cpu_engine(compile):
    """fp32: greedy tokens equal and log-probs within 1e-4 of the CPU engine (no Triton there),
    a single request (the GEMV) and a batch of different lengths (the attention's splits); then
    without log-probs, so that the graphs run 8 greedy steps back to back, the same tokens."""
    model = GPTModel(ModelConfig(**CONFIG))
    initialize_parameters(model, seed=4)
    on_gpu = copy.deepcopy(model).cuda()
    generator = torch.Generator().manual_seed(2)
    for lengths in ((150,), (3, 40, 200, 77)):
        prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in lengths]
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)
        expected = Engine(model, max_requests=4, decode_steps=1).generate(prompts, params)
        engine = Engine(on_gpu, max_requests=4, compile=compile)
        actual = engine.generate(prompts, params)
        for e, a in zip(expected, actual):
            assert a.token_ids == e.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-4)
        greedy = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
        assert [c.token_ids for c in greedy] == [e.token_ids for e in expected]
        assert any(greedy_graph for _, _, greedy_graph in engine.runner.graphs.graphs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_fused_decode_step_equals_the_model(dtype, rotary_percent):
    """One decode step after a random cache: logits and the cache's new key and value. fp32 to the
    order of summation; bf16 to its rounding (a wrong norm, rotation or slot moves them by >10%)."""
    with torch.device("cuda"):
        model = GPTModel(ModelConfig(**{**CONFIG, "rotary_percent": rotary_percent}))
    initialize_parameters(model, seed=6)
    model.to(dtype).eval()
    assert fused_decode.supported(model)
    block_size = 16
    caches = []
    for _ in range(2):
        cache = PagedKVCache(PagedKVCache.model_shapes(model), 12, block_size, dtype=dtype, device="cuda")
        for pool in cache.pools.values():
            torch.manual_seed(0)
            for part in pool:
                part.normal_()
        caches.append(cache)
    tables, position, token = torch.tensor([[4, 9, 2]], device="cuda"), torch.tensor([37], device="cuda"), \
        torch.tensor([11], device="cuda")
    with torch.no_grad():
        expected = forward_tokens(model, token[None], position[None],
                                  StepAttention.decode_only(caches[0].pools, block_size, position, tables))
        actual = fused_decode.decode_logits(model, token, position,
                                            StepAttention.decode_only(caches[1].pools, block_size, position, tables))
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((actual.float() - expected.float()).norm() / expected.float().norm()).item() < bound
    for index in caches[0].pools:
        for e, a in zip(caches[0].pools[index], caches[1].pools[index]):
            assert ((a.float() - e.float()).norm() / e.float().norm()).item() < bound



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_into_equals_torch_argmax(dtype):
    """Rows of logits wider than the vocabulary (the padding columns hold the largest values and
    must be ignored), with ties (bf16 rounds many logits together): the first maximal index."""
    generator = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(33, 32064, device="cuda", generator=generator).to(dtype)
    logits[:, 32000:] = 100.0
    logits[3, [7, 31999]] = 50.0                  # a tie: index 7
    out = torch.full((33,), -1, dtype=torch.int64, device="cuda")
    argmax.argmax_into(logits, 32000, out)
    assert out.tolist() == logits[:, :32000].argmax(dim=-1).tolist()
    assert out[3].item() == 7
