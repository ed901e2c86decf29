"""Attention over the paged KV cache, for one forward pass of many requests at once.

A step's tokens are laid out flat, [1, tokens], in three groups:

    decode rows     one new token each, after a cached context (and prompts of one token)
    fresh rows      whole prompts or their first chunk: nothing cached before them
    continued rows  later chunks of a prompt, or prompts after a cached prefix

Every layer's attention module computes q, k, v as in training and hands them to
`LayerCache.attend` (in the slot where packed training samples pass their Documents):
k and v go into the cache at the tokens' slots, then

- decode rows attend, all together, to their contexts: on CUDA read in place through their
  block tables (tessera.kernels.paged_decode); elsewhere gathered from the pool (padded to
  the longest, the padding masked), the query heads of a KV group laid side by side as that
  group's queries, so that SDPA needs no GQA mode;
- fresh rows attend causally within themselves (tessera.models.documents: per-prompt SDPA,
  or FlashAttention's variable-length kernel on CUDA);
- each continued row attends to its whole context with a causal mask aligned to the
  bottom right: query i of L sits at position C - L + i of a context of C. (SDPA's
  `is_causal` aligns the top left, wrong whenever L < C: PyTorch's torch.nn.attention.bias,
  causal_upper_left against causal_lower_right.)

Multi-latent attention calls `LatentLayerCache.attend_latent` instead (tessera.models.mla's
hook): the cache keeps each token's latent and positional key, and every read of the context
expands the gathered latents through the layer's kv_up into keys and values, then attends
as above (DeepSeek's "absorbed" form, kv_up folded into the queries, is not done here).

With attention sinks or a sliding window (GPT-OSS) every group reads the gathered context in
torch ops (tessera.models.attention_sinks.reference_attention: the window in the mask, the
sink in the softmax) and fresh rows go through tessera.models.attention_sinks; the Triton
decode kernel has neither yet.

The decode group alone (`StepAttention.decode_only`) is what the CUDA graphs capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.kernels import paged_decode
from tessera.models.attention_sinks import reference_attention, sink_window_attention
from tessera.models.documents import Documents, default_backend


@dataclass(frozen=True)
class ContinuedRow:
    """A multi-token row after a cached context: `length` queries ending a context of `context` tokens."""

    length: int
    context: int
    blocks: torch.Tensor    # the row's block ids covering the context, on the device


@dataclass
class StepAttention:
    """Where one forward pass's tokens go in the cache and what each attends to."""

    pools: dict[int, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]   # PagedKVCache.pools
    block_size: int
    slots: torch.Tensor                          # [tokens] int64: each token's cache slot
    decode_tables: torch.Tensor | None = None    # [decode rows, blocks] int64
    decode_positions: torch.Tensor | None = None   # [decode rows] int64: the new tokens' positions
    fresh: Documents | None = None
    continued: list[ContinuedRow] = field(default_factory=list)

    @classmethod
    def decode_only(cls, pools, block_size: int, positions: torch.Tensor, tables: torch.Tensor) -> "StepAttention":
        """One new token per row at `positions` [rows]: slots computed on the device."""
        slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
        return cls(pools, block_size, slots, tables, positions)

    @staticmethod
    def fresh_documents(lengths: list[int], device: torch.device, dtype: torch.dtype) -> Documents | None:
        """Causal attention within each fresh row (None without fresh rows)."""
        if not lengths:
            return None
        backend = "varlen" if default_backend(torch.device(device), dtype, dropout=False) == "varlen" \
            else "per_document"
        bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return Documents.from_cu_seqlens(bounds, 1, sum(lengths), backend=backend, device=device)

    def layer(self, index: int) -> "LayerCache | LatentLayerCache":
        pool = self.pools[index]
        return LayerCache(self, *pool) if isinstance(pool, tuple) else LatentLayerCache(self, pool)


class LayerCache:
    """One layer's view of the step: `attend` has the signature of Documents.attend."""

    def __init__(self, step: StepAttention, keys: torch.Tensor, values: torch.Tensor):
        self.step, self.keys, self.values = step, keys, values

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
               enable_gqa: bool = False, scale: float | None = None, sinks: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
        """q [1, heads, tokens, d], k, v [1, kv heads, tokens, d] -> [1, heads, tokens, d_v]; with
        per-head `sinks` logits and a `window` of earlier keys when given."""
        self.keys[self.step.slots] = k[0].transpose(0, 1)
        self.values[self.step.slots] = v[0].transpose(0, 1)
        block_size = self.step.block_size
        return _attend_rows(self.step, q, lambda start, end: (k[:, :, start:end], v[:, :, start:end]),
                            lambda tables: (_gather(self.keys, tables, block_size).transpose(1, 2),
                                            _gather(self.values, tables, block_size).transpose(1, 2)),
                            enable_gqa=enable_gqa, scale=scale, pools=(self.keys, self.values), sinks=sinks,
                            window=window)


class LatentLayerCache:
    """One MLA layer's view of the step: its pool holds each token's [normed latent | rotated
    positional key]; attention expands the context's latents through the layer's kv_up into
    this rank's heads' keys and values ("expand on read")."""

    def __init__(self, step: StepAttention, pool: torch.Tensor):
        self.step, self.pool = step, pool

    def attend_latent(self, layer, q: torch.Tensor, latent: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """q [1, heads, tokens, d], latent [1, tokens, kv_lora_rank], k_pos [1, tokens, pos dim]
        -> [1, heads, tokens, d_v]."""
        self.pool[self.step.slots] = torch.cat([latent, k_pos], dim=-1)[0]
        block_size = self.step.block_size
        return _attend_rows(self.step, q,
                            lambda start, end: _expand(layer, latent[:, start:end], k_pos[:, start:end]),
                            lambda tables: _expand(layer, *_gather(self.pool, tables, block_size).split(
                                [layer.kv_lora_rank, layer.pos_dim], dim=-1)),
                            enable_gqa=False, scale=layer.softmax_scale)


def _expand(layer, latent: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents [rows, n, kv_lora_rank] and positional keys [rows, n, pos dim] -> MLA's keys
    [rows, heads, n, d] ([k_nope | k_pos], k_pos shared by the heads) and values [rows, heads, n, d_v]."""
    k_nope, v = layer.expand_latent(latent)
    k = torch.cat([k_nope, k_pos[:, :, None].expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


Fresh = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
Context = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _attend_rows(step: StepAttention, q: torch.Tensor, fresh_kv: Fresh, context_kv: Context, *,
                 enable_gqa: bool, scale: float | None,
                 pools: tuple[torch.Tensor, torch.Tensor] | None = None, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
    """The step's row groups in turn: `fresh_kv(start, end)` gives the keys and values
    [1, kv heads, end - start, d] of the step's own tokens start..end-1, `context_kv(tables)`
    those [rows, kv heads, blocks * block_size, d] of the cached blocks of block tables [rows, blocks].
    With the (key, value) `pools` on a GPU, decode rows read them in place (tessera.kernels.paged_decode)."""
    outputs, start = [], 0
    plain = sinks is None and window is None
    if step.decode_tables is not None and pools is not None and plain and paged_decode.available(q):
        rows = step.decode_tables.shape[0]
        out = paged_decode.paged_decode_attention(q[0, :, :rows].transpose(0, 1), *pools, step.decode_tables,
                                                  step.decode_positions, step.block_size,
                                                  q.shape[-1] ** -0.5 if scale is None else scale)
        outputs.append(out.transpose(0, 1)[None])
        start = rows
    elif step.decode_tables is not None:
        rows = step.decode_tables.shape[0]
        context = torch.arange(step.decode_tables.shape[1] * step.block_size, device=q.device)
        allowed = _within_window(context, step.decode_positions[:, None], window)[:, None, :]   # [rows, 1, keys]
        out = _attend_cached(q[0, :, :rows].transpose(0, 1)[:, :, None], *context_kv(step.decode_tables), allowed,
                             scale, sinks)
        outputs.append(out[:, :, 0].transpose(0, 1)[None])
        start = rows
    if step.fresh is not None:
        end = start + step.fresh.seq_length
        if plain:
            outputs.append(step.fresh.attend(q[:, :, start:end], *fresh_kv(start, end), enable_gqa=enable_gqa,
                                             scale=scale))
        else:
            outputs.append(sink_window_attention(q[:, :, start:end], *fresh_kv(start, end), sinks, window, step.fresh,
                                                 enable_gqa=enable_gqa, scale=scale))
        start = end
    for row in step.continued:
        end = start + row.length
        offset = row.context - row.length
        queries = torch.arange(row.length, device=q.device)[:, None] + offset
        allowed = _within_window(torch.arange(row.context, device=q.device), queries, window)[None]   # [1, L, C]
        outputs.append(_attend_cached(q[:, :, start:end], *context_kv(row.blocks[None]), allowed, scale, sinks))
        start = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _within_window(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key positions `keys` a query at `queries` sees: those up to it, and no more than `window` before it."""
    allowed = keys <= queries
    return allowed if window is None else allowed & (keys >= queries - window)


def _attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                   scale: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, heads, L, d] against gathered keys and values [rows, kv heads, >= keys, d], where
    `allowed` [rows, L, keys] -> [rows, heads, L, d_v]; with `sinks`, in torch ops."""
    keys, values = keys[:, :, :allowed.shape[-1]], values[:, :, :allowed.shape[-1]]
    if sinks is not None:
        return reference_attention(q, keys, values, sinks, allowed, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows, heads, length, _ = q.shape
    groups = keys.shape[1]
    # The heads of a KV group become that group's queries: [rows, groups, heads/groups * L, d].
    q = q.reshape(rows, groups, heads // groups * length, -1)
    mask = allowed[:, None].repeat(1, 1, heads // groups, 1)   # [rows, 1, heads/groups * L, keys]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(rows, heads, length, -1)


def _gather(pool: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of each row's blocks, [rows, blocks * block_size, ...] (a copy)."""
    rows, blocks = tables.shape
    per_block = pool.view(-1, block_size, *pool.shape[1:])
    return per_block[tables].view(rows, blocks * block_size, *pool.shape[1:])
