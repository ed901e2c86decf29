"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464), in chunks.

    o = gated_delta_rule(q, k, v, g, beta, document_ids=ids)
    o, final = gated_delta_rule(q, k, v, g, beta, initial_states=S0, return_final_states=True)   # generation
    o, S = gated_delta_step(S, q_t, k_t, v_t, g_t, beta_t)                                  # one token

Per value head, with state S [K, V] starting at zero (and again at the first token of every
document), q and k L2-normalised and q scaled by K^-0.5 (Qwen3-Next's use_qk_l2norm_in_kernel):

    S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

(S [K, V] maps keys to values; the paper writes its transpose.) q and k [b, s, key_heads, K],
v [b, s, value_heads, V], g and beta [b, s, value_heads]: g the log decay (<= 0), beta the write
strength in (0, 1). Each query/key head serves value_heads // key_heads consecutive value heads.
`document_ids` [b, s] (optional) names each token's document: no state crosses from one to the next.
`initial_states` [b, value_heads, K, V] (optional) is the state before the first token, carried into
its document; `return_final_states` also returns the state after the last token (of its document),
in fp32 (or fp64): what the inference engine keeps per request between a prompt's chunks, and what
`gated_delta_step` advances one token at a time while it decodes (as transformers' Qwen3-Next
cache does with its recurrent_states; flash-linear-attention calls them initial_state and
output_final_state).

Backends (`BACKENDS`; the PyTorch one unless named):
- "torch": the paper's chunkwise form (its section 3.3, as flash-linear-attention and
  transformers' torch_chunk_gated_delta_rule compute it) in PyTorch ops, in fp32 (or fp64).
  Within a chunk of `chunk_size` tokens the delta rule's updates are gathered into one
  triangular solve (the WY/UT representation) and a masked product; the state passes from chunk
  to chunk in a loop. Documents are masks: a token sees its own document's tokens and carried
  state only. It runs anywhere, is the CPU oracle (tests check it against the fp64 recurrence),
  and is the default.
- "fla": flash-linear-attention's Triton kernel (`chunk_gated_delta_rule`, documents as its
  `cu_seqlens`), on CUDA where that package is installed (pip install flash-linear-attention).
  Not yet measured against the PyTorch path, so it is chosen by name only, never by default.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tessera.kernels.precision import without_autocast

BACKENDS = ("torch", "fla")
CHUNK_SIZE = 64   # Megatron's GatedDeltaNet and transformers' Qwen3-Next
L2_EPS = 1e-6     # flash-linear-attention's l2norm


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     document_ids: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE, backend: str = "torch",
                     initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """o [b, s, value_heads, V] in v's dtype, and with `return_final_states` the state after the last
    token [b, value_heads, K, V] (see the module docstring)."""
    if backend == "fla":
        out, final = _fla(q, k, v, g, beta, document_ids, initial_states)
    elif backend == "torch":
        out, final = _chunked(q, k, v, g, beta, document_ids, chunk_size, initial_states)
    else:
        raise ValueError(f"gated delta rule backend '{backend}': choose one of {', '.join(BACKENDS)}")
    return (out, final) if return_final_states else out


@without_autocast
def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one token of each row, no chunks: state [rows, value_heads, K, V], q and k
    [rows, key_heads, K], v [rows, value_heads, V], g and beta [rows, value_heads] -> (o [rows,
    value_heads, V] in v's dtype, the next state in the state's dtype)."""
    dtype = state.dtype
    q, k = _normalized_heads(q, k, v.shape[1], dtype)
    g, beta, values = g.to(dtype), beta.to(dtype), v.to(dtype)
    state = state * g.exp()[..., None, None]
    error = values - (k.unsqueeze(-2) @ state).squeeze(-2)           # v minus what S predicts for k
    state = state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * error).unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2).to(v.dtype), state


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def _normalized_heads(q: torch.Tensor, k: torch.Tensor, heads: int, dtype: torch.dtype):
    """q and k [..., key_heads, K] -> [..., heads, K] in `dtype`, L2-normalised, q scaled by K^-0.5."""
    q, k = (l2_normalized(t.to(dtype)).repeat_interleave(heads // k.shape[-2], dim=-2) for t in (q, k))
    return q * q.shape[-1] ** -0.5, k


@without_autocast
def _chunked(q, k, v, g, beta, document_ids, chunk_size: int, initial_states) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, _ = v.shape
    dtype = torch.promote_types(v.dtype, torch.float32)   # fp32 at least; fp64 stays fp64 (the tests)
    q, k = _normalized_heads(q, k, heads, dtype)
    if document_ids is None:
        document_ids = torch.zeros(batch, seq, dtype=torch.int32, device=v.device)
    pad = -seq % chunk_size   # zeros at the end (beta 0: no update); the padded tokens join the last document
    chunks = (seq + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:   # [b, s, heads, ...] -> [b, heads, chunks, chunk_size, ...]
        t = F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(batch, chunks, chunk_size, *t.shape[2:]).movedim(3, 1)

    qs, ks, vs, betas, log_decay = chunked(q), chunked(k), chunked(v), chunked(beta), chunked(g).cumsum(-1)
    ids = torch.cat([document_ids, document_ids[:, -1:].expand(batch, pad)], dim=1).view(batch, 1, chunks, chunk_size)
    same_document = ids.unsqueeze(-1) == ids.unsqueeze(-2)                             # [b, 1, c, i, j]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    gaps = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~(same_document & causal), -torch.inf)
    decay = gaps.exp()                                   # exp(sum of g over (j, i]) where j may reach i, else 0
    # Tokens whose document was running when the chunk began read (and correct) the entering state. The
    # document running as a chunk begins: the previous chunk's last; before the first, the initial
    # state's (the first token's) or none.
    before = ids[..., :1, 0] if initial_states is not None else torch.full_like(ids[..., :1, -1], -1)
    previous_last = torch.cat([before, ids[..., :-1, -1]], dim=-1)
    from_start = log_decay.exp() * (ids == previous_last.unsqueeze(-1))               # [b, heads, c, l]

    # The chunk's delta-rule updates in WY form: (I + strictly_lower(beta K K^T * decay)) [U | W] = beta [V | K e^G]
    system = (betas.unsqueeze(-1) * (ks @ ks.transpose(-1, -2)) * decay).tril(-1)
    identity = torch.eye(chunk_size, dtype=dtype, device=v.device)
    both = torch.cat([betas.unsqueeze(-1) * vs, (betas * from_start).unsqueeze(-1) * ks], dim=-1)   # one solve
    values, state_keys = torch.linalg.solve_triangular(system + identity, both, upper=False).split(
        [vs.shape[-1], ks.shape[-1]], dim=-1)
    attention = (qs @ ks.transpose(-1, -2)) * decay                                   # within the chunk, causal
    reading = qs * from_start.unsqueeze(-1)                                           # q_i e^{G_i} on the state

    # The state at each chunk's end: decayed in from the last token's position, that token's document only.
    last = ids[..., -1:]
    to_end = (log_decay[..., -1:] - log_decay).exp() * (ids == last)
    carried = log_decay[..., -1].exp() * (last.squeeze(-1) == previous_last)          # [b, heads, c]
    state = vs.new_zeros(batch, heads, k.shape[-1], v.shape[-1]) if initial_states is None else initial_states.to(dtype)
    outputs = []
    for chunk in range(chunks):
        new_values = values[:, :, chunk] - state_keys[:, :, chunk] @ state           # v minus what S predicts
        outputs.append(reading[:, :, chunk] @ state + attention[:, :, chunk] @ new_values)
        state = state * carried[:, :, chunk, None, None] \
            + (ks[:, :, chunk] * to_end[:, :, chunk].unsqueeze(-1)).transpose(-1, -2) @ new_values
    out = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * chunk_size, -1)[:, :, :seq]
    return out.transpose(1, 2).to(v.dtype), state


@functools.cache
def _fla_kernel():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _fla(q, k, v, g, beta, document_ids, initial_states) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _fla_kernel() if v.is_cuda else None
    if kernel is None:
        raise ValueError("gated delta rule backend 'fla' needs CUDA and the flash-linear-attention package "
                         "(pip install flash-linear-attention)")
    batch, seq, heads, _ = v.shape
    per_key_head = heads // k.shape[2]
    q, k = (t.repeat_interleave(per_key_head, dim=2) for t in (q, k))
    if document_ids is None:
        return kernel(q, k, v, g=g, beta=beta, initial_state=initial_states, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    if initial_states is not None:   # its varlen form wants one state per document
        raise ValueError("gated delta rule backend 'fla': initial_states with document_ids is not supported")
    # One varlen row: a new sequence at every document start and at every row start.
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    cu_seqlens = F.pad(starts.flatten().nonzero().flatten(), (0, 1), value=batch * seq)
    flat = [t.reshape(1, batch * seq, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out, final = kernel(*flat[:3], g=flat[3], beta=flat[4], output_final_state=True, use_qk_l2norm_in_kernel=True,
                        cu_seqlens=cu_seqlens)
    return out.view(batch, seq, heads, -1), final[starts.sum(1).cumsum(0) - 1]   # each row's last sequence
