"""Causal attention with sinks and a sliding window (GPT-OSS), on FlexAttention or a CPU reference.

Attention sinks (arXiv 2309.17453; GPT-OSS's learned form, Megatron's --softmax-type learnable)
add one logit per head to every query's softmax denominator without a value:

    p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)),   out = sum_j p_j v_j

so a query may give little weight to every key. With lse = log sum_i exp(s_i), the usual
attention output o (weights summing to 1) becomes o * sigmoid(lse - sink): that is how the
GPU path computes it, from FlexAttention's output and its log-sum-exp (whose gradient
FlexAttention's compiled backward takes). A window of `left` keeps key j for query i when
i - left <= j <= i (Megatron's --window-size LEFT,0; Hugging Face's sliding_window is LEFT + 1);
with packed documents keys also stay within the query's document. Both are FlexAttention
block masks, so blocks outside the window or the document are skipped, never a dense mask.

On a CPU FlexAttention has no backward; there the reference computes the scores, the mask
and the softmax with the sink column in plain torch ops (the tests' sizes).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from tessera.models.documents import Documents


def sink_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                          window: int | None, documents: Documents | None = None, *, enable_gqa: bool = False,
                          scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [b, heads, s, d] over k, v [b, groups, s, d] with per-head sink logits
    `sinks` [heads] (or None) and a window of `window` earlier keys (or None: all of them),
    within each packed document when `documents` are given -> [b, heads, s, d_v]."""
    if documents is not None and not isinstance(documents, Documents):   # the inference engine's cache
        return documents.attend(q, k, v, enable_gqa=enable_gqa, scale=scale, sinks=sinks, window=window)
    if q.is_cuda:
        return flex_sink_attention(q, k, v, sinks, window, documents, enable_gqa=enable_gqa, scale=scale)
    return reference_attention(q, k, v, sinks, allowed_keys(q.shape[2], window, documents, q.device), scale=scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                        allowed: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """The same in torch ops, with `allowed` [b or 1, queries, keys] (True where a query sees a key); softmax
    in fp32 at least."""
    heads, groups = q.shape[1], k.shape[1]
    if groups != heads:
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)).to(dtype) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return probs.to(v.dtype) @ v


def allowed_keys(seq_length: int, window: int | None, documents: Documents | None,
                 device: torch.device) -> torch.Tensor:
    """[b or 1, s, s] boolean: causal, within `window`, within each document."""
    position = torch.arange(seq_length, device=device)
    distance = position[:, None] - position[None, :]
    allowed = (distance >= 0) & (distance <= (window if window is not None else seq_length))
    if documents is None:
        return allowed[None]
    ids = documents.token_ids()
    return allowed[None] & (ids[:, :, None] == ids[:, None, :])


# -- FlexAttention ---------------------------------------------------------------------------

def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                        window: int | None, documents: Documents | None, *, enable_gqa: bool = False,
                        scale: float | None = None) -> torch.Tensor:
    """sink_window_attention's GPU path (on a CPU: forward only, every score computed)."""
    block_mask = block_mask_for(q.shape[2], window, documents, q.device)
    direct = not q.is_cuda or torch.compiler.is_compiling()   # uncompiled: the reference implementation
    flex = flex_attention if direct else _compiled_flex()
    if sinks is None:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale)
    out, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, scale=scale,
                    return_aux=AuxRequest(lse=True))
    weight = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])   # sum_j p_j without the sink
    return out * weight[..., None].to(out.dtype)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


# Block masks: per (length, window, device) without documents; per Documents (one micro-batch's,
# shared by its layers) and window with them, dropped with the Documents.
_DOCUMENT_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_mask_for(seq_length: int, window: int | None, documents: Documents | None, device: torch.device):
    """The block mask of causal (windowed) attention, within each document; built outside any
    compiled graph."""
    return _untraced(_block_mask_for)(seq_length, window, documents, device)


@functools.cache
def _untraced(fn):
    """`fn` hidden from Dynamo, wrapped at first use rather than at import: torch.compiler loads
    torch._dynamo, ~2 s that every command loading a model would pay."""
    return torch.compiler.disable(fn)


def _block_mask_for(seq_length: int, window: int | None, documents: Documents | None, device: torch.device):
    if documents is None:
        return _plain_block_mask(seq_length, window, device)
    masks = _DOCUMENT_MASKS.setdefault(documents, {})
    if window not in masks:
        ids = documents.token_ids()
        causal = _causal_window(window)

        def mask(b, h, q_index, kv_index):
            return causal(b, h, q_index, kv_index) & (ids[b, q_index] == ids[b, kv_index])

        masks[window] = _build(mask, documents.batch_size, seq_length, device)
    return masks[window]


@functools.lru_cache(maxsize=32)
def _plain_block_mask(seq_length: int, window: int | None, device: torch.device):
    return _build(_causal_window(window), None, seq_length, device)


def _causal_window(window: int | None):
    def mask(b, h, q_index, kv_index):
        keep = q_index >= kv_index
        return keep if window is None else keep & (q_index - kv_index <= window)
    return mask


def _build(mask, batch: int | None, seq_length: int, device: torch.device):
    # Compiled on CUDA, the mask is evaluated block by block; eager it is built whole (CPU tests only).
    build = _compiled_block_mask() if device.type == "cuda" else create_block_mask
    return build(mask, batch, None, seq_length, seq_length, device=device)


@functools.cache
def _compiled_block_mask():
    return torch.compile(create_block_mask)
