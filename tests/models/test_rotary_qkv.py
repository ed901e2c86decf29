"""RoPE on the QKV output in one op (tessera.kernels.rope.rotary_qkv; the Triton kernels run on
CUDA, tests/gpu/test_rope_cuda.py): its torch path's gradients against finite differences, its
outputs against apply_rotary on the split, and attention through it against the plain path."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.kernels.rope import apply_rotary, rotary_qkv, rotary_qkv_backward
from tessera.models.attention import Attention
from tessera.models.gpt import initialize_parameters
from tessera.models.rope import RotaryEmbedding


def _tables(seq: int, d: int, position_ids: torch.Tensor | None = None, dtype=torch.float64):
    cos, sin = RotaryEmbedding(d, 10000.0, seq)(seq, position_ids)
    return cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("positions", [False, True], ids=["whole sequence", "position ids"])
def test_rotary_qkv_is_apply_rotary_on_the_split_and_its_gradients_are_the_numerical_ones(positions):
    generator = torch.Generator().manual_seed(0)
    batch, seq, heads, groups, d = 2, 5, 4, 2, 6
    position_ids = torch.randint(0, 9, (batch, seq), generator=generator) if positions else None
    cos, sin = _tables(9, d, position_ids)
    if position_ids is None:
        cos, sin = cos[:seq], sin[:seq]
    qkv = torch.randn(batch, seq, (heads + 2 * groups) * d, dtype=torch.float64, generator=generator,
                      requires_grad=True)
    q, k, v = rotary_qkv(qkv, cos, sin, heads, groups)
    split = qkv.detach().view(batch, seq, -1, d).split([heads, groups, groups], dim=2)
    torch.testing.assert_close(q, apply_rotary(split[0], cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(k, apply_rotary(split[1], cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(v, split[2], rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda t: rotary_qkv(t, cos, sin, heads, groups), (qkv,))
    torch.library.opcheck(rotary_qkv, (qkv.detach().float(), cos.float(), sin.float(), heads, groups))
    first = [t[:1] if t.dim() == 3 else t[:1, :1] for t in (cos, sin)]
    one_token = rotary_qkv(qkv.detach()[:1, :1], *first, heads, groups)   # a decode step's shape
    assert one_token[2].data_ptr() != qkv.data_ptr() + (heads + groups) * d * qkv.element_size()  # v copied
    grads = [torch.randn(t.shape, generator=generator) for t in (q, k, v)]
    torch.library.opcheck(rotary_qkv_backward, (*grads, cos.float(), sin.float()))


def _plain_rotary_qkv(qkv, cos, sin, heads, groups):
    """The op's reference: apply_rotary on views of the split, differentiated by autograd."""
    batch, seq, width = qkv.shape
    q, k, v = qkv.view(batch, seq, -1, width // (heads + 2 * groups)).split([heads, groups, groups], dim=2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def test_attention_through_rotary_qkv_equals_the_plain_path(monkeypatch):
    """Attention's output and every gradient with the op as with apply_rotary under autograd (fp32)."""
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         group_query_attention=True, vocab_size=32, seq_length=8, position_embedding_type="rope",
                         attention_dropout=0.0)
    attention = Attention(config, output_std=0.02)
    initialize_parameters(attention, seed=3)
    rope = RotaryEmbedding(config.kv_channels, 10000.0, 8)(8, None)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    calls, results = [], []
    for plain in (False, True):
        op = _plain_rotary_qkv if plain else rotary_qkv
        monkeypatch.setattr("tessera.models.attention.rotary_qkv", lambda *args, op=op: calls.append(op) or op(*args))
        xi = x.clone().requires_grad_()
        attention.zero_grad()
        out = attention(xi, rope)
        out.square().sum().backward()
        results.append([out, xi.grad, *(p.grad for p in attention.parameters())])
    assert calls == [rotary_qkv, _plain_rotary_qkv] and len(results[0]) == 2 + len(list(attention.parameters()))
    for fused, plain in zip(*results):
        assert (fused - plain).norm() <= 1e-6 * plain.norm()
