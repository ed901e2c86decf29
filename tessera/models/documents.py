"""Packed documents: attention that stays inside each document, without an [s, s] mask.

With --reset-attention-mask a sample of seq_length tokens holds several documents, and a
token attends only to itself and the earlier tokens of its own document. The boundaries
are Megatron's THD metadata (PackedSeqParams): `cu_seqlens`, the int32 cumulative
document lengths over a micro-batch's batch x seq tokens read row after row, from 0 to
batch x seq; no document crosses a sample. Each sample carries its own (tessera.data.
gpt_dataset), the loader joins them per micro-batch (tessera.data.loader), and
`Documents` holds them on the compute device with what the chosen kernel needs, built
once per micro-batch for every layer. Every pipeline stage reads the same micro-batches
from its own loader, so nothing of this travels between stages. A context-parallel split
can cut each document as it cuts a sample and build each rank's Documents from the
pieces.

Kernels, all exact (the dense mask's maths); `default_backend` picks one:

- "per_document": causal SDPA on each document in turn: plain, one launch per document.
- "varlen": torch.nn.attention.varlen (FlashAttention's variable-length kernel; CUDA,
  bf16/fp16): all documents of the micro-batch in one launch.
- "flex": FlexAttention with a document block mask, compiled: 128 x 128 blocks that lie
  outside every document are skipped.
- "dense": SDPA with the [b, s, s] boolean mask, what --reset-attention-mask did before:
  kept as the baseline the others are measured against, and as the tests' oracle.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

BACKENDS = ("per_document", "varlen", "flex", "dense")


def default_backend(device: torch.device, dtype: torch.dtype, dropout: bool) -> str:
    """The document kernel for a device and compute dtype, chosen here alone so that a
    benchmark can time each backend by name and the choice can follow the measurements.

    Only SDPA has attention dropout, and on a CPU the fused kernels do not run (varlen is
    CUDA-only; flex uncompiled computes every score): per-document SDPA there. On CUDA,
    varlen where FlashAttention takes the dtype, flex for fp32 or a torch without varlen.
    Forward + backward on an H200, torch 2.11, bf16, heads of 128 (first measurements,
    not yet a sweep): 8 documents x 1024, 32 heads: varlen 1.39 ms, flex 2.19
    (a first probe, no script kept); 8k tokens in 10 documents, 32 heads over 8 KV
    groups: flex 1.45 ms, varlen 1.77 (dense mask 12.3, per-document 19.0); 32k tokens in
    32 documents: varlen 7.46 ms, flex 9.36. Flex's first block mask compiles for ~1 min.
    """
    if dropout or device.type != "cuda":
        return "per_document"
    if dtype in (torch.float16, torch.bfloat16) and _load_varlen() is not None:
        return "varlen"
    return "flex"


# Not frozen: torch.compile rebuilds a frozen dataclass passed to an uncompiled call (the
# per-document loop) from all its fields, guarding on the number of documents, so that
# every layout would compile anew.
@dataclass(eq=False)
class Documents:
    """The documents of one micro-batch, and the kernel that attends within them (built once, read-only)."""

    cu_seqlens: torch.Tensor           # int32 [documents + 1], on the compute device
    lengths: tuple[int, ...]           # the documents' lengths in order, on the host
    max_seqlen: int
    batch_size: int
    seq_length: int
    backend: str
    kernel: Callable                   # the backend's: (q, k, v, documents, dropout_p, enable_gqa, scale)
    block_mask: object | None = None   # "flex": the BlockMask
    dense_mask: torch.Tensor | None = None   # "dense": [b, 1, s, s], True where attention is allowed

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch_size: int, seq_length: int, *, backend: str,
                        device: torch.device) -> "Documents":
        """From host cu_seqlens over batch_size x seq_length tokens (checked here, once)."""
        if backend not in BACKENDS:
            raise ValueError(f"document attention backend '{backend}': choose one of {', '.join(BACKENDS)}")
        bounds = cu_seqlens.tolist()
        total = batch_size * seq_length
        rows = set(range(0, total + 1, seq_length))
        if bounds[:1] != [0] or bounds[-1] != total or any(a >= b for a, b in zip(bounds, bounds[1:])) \
                or not rows <= set(bounds):
            raise ValueError(f"--reset-attention-mask: cu_seqlens must rise strictly from 0 to {total} and hold "
                             f"every sample boundary (a multiple of {seq_length}), got {bounds}")
        cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
        lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        if backend == "varlen" and _load_varlen() is None:
            raise ValueError("document attention backend 'varlen': this torch has no torch.nn.attention.varlen")
        block_mask = dense_mask = None
        if backend in ("flex", "dense"):
            ids = _token_ids(cu, len(lengths), batch_size, seq_length)
            if backend == "flex":
                block_mask = _document_block_mask(ids)
            else:
                causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).tril()
                dense_mask = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]
        return cls(cu, lengths, max(lengths), batch_size, seq_length, backend, _kernel(backend), block_mask,
                   dense_mask)

    def token_ids(self) -> torch.Tensor:
        """int32 [b, s]: each token's document, numbered from 0 across the micro-batch (the
        recurrent layers restart their state where it changes, tessera.models.mamba)."""
        return _token_ids(self.cu_seqlens, len(self.lengths), self.batch_size, self.seq_length)

    @property
    def squared_lengths(self) -> int:
        """Sum of the squared document lengths: what causal attention's work grows with."""
        return sum(length * length for length in self.lengths)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
               enable_gqa: bool = False, scale: float | None = None) -> torch.Tensor:
        """softmax(q k^T * scale) v within each document, causal (scale 1/sqrt(d) by default);
        q [b, heads, s, d], k, v [b, groups, s, d]."""
        if (q.shape[0], q.shape[2]) != (self.batch_size, self.seq_length):
            raise ValueError(f"documents of {self.batch_size} x {self.seq_length} tokens, attention over "
                             f"{q.shape[0]} x {q.shape[2]}")
        if dropout_p > 0 and self.backend not in ("per_document", "dense"):
            raise ValueError(f"--attention-dropout: the '{self.backend}' document kernel has no dropout")
        return self.kernel(q, k, v, self, dropout_p, enable_gqa, scale)


def _token_ids(cu_seqlens: torch.Tensor, documents: int, batch_size: int, seq_length: int) -> torch.Tensor:
    numbers = torch.arange(documents, device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(numbers, cu_seqlens.diff(), output_size=batch_size * seq_length).view(
        batch_size, seq_length)


# -- the kernels: (q, k, v, documents, dropout_p, enable_gqa, scale) -> [b, heads, s, d_v] --

def _per_document(q, k, v, documents: Documents, dropout_p: float, enable_gqa: bool, scale) -> torch.Tensor:
    outputs, start = [], 0
    for length in documents.lengths:
        row, begin = divmod(start, documents.seq_length)
        span = slice(begin, begin + length)
        outputs.append(F.scaled_dot_product_attention(q[row, :, span], k[row, :, span], v[row, :, span],
                                                      is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa,
                                                      scale=scale))
        start += length
    # [heads, b*s, d] in token order -> [b, heads, s, d]
    return torch.cat(outputs, dim=1).unflatten(1, (documents.batch_size, documents.seq_length)).transpose(0, 1)


def _dense(q, k, v, documents: Documents, dropout_p: float, enable_gqa: bool, scale) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.dense_mask, dropout_p=dropout_p,
                                          enable_gqa=enable_gqa, scale=scale)


def _flex(q, k, v, documents: Documents, dropout_p: float, enable_gqa: bool, scale) -> torch.Tensor:
    # Inside a compiled block the call compiles with it; eager, it needs compiling on its own
    # (uncompiled it is the reference implementation: every score materialised; CPU tests only).
    direct = not q.is_cuda or torch.compiler.is_compiling()
    flex = flex_attention if direct else _compiled(flex_attention)
    return flex(q, k, v, block_mask=documents.block_mask, enable_gqa=enable_gqa, scale=scale)


def _varlen(q, k, v, documents: Documents, dropout_p: float, enable_gqa: bool, scale) -> torch.Tensor:
    varlen_attn, takes_gqa = _varlen_api   # loaded when the Documents were built
    if enable_gqa and not takes_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    b, heads, s, _ = q.shape
    tokens = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3])  # noqa: E731  THD layout
    cu, longest = documents.cu_seqlens, documents.max_seqlen
    out = varlen_attn(tokens(q), tokens(k), tokens(v), cu, cu, longest, longest, scale=scale,
                      window_size=(-1, 0), **({"enable_gqa": enable_gqa} if takes_gqa else {}))  # (-1, 0): causal
    return out.view(b, s, heads, -1).transpose(1, 2)


@functools.cache
def _kernel(backend: str):
    """A backend's kernel. The per-document loop stays out of compiled graphs (a Python loop over
    this micro-batch's documents: compiled, each new layout would be a new graph); wrapped on
    first use, since torch.compiler loads torch._dynamo, a second at every process start."""
    if backend == "per_document":
        return torch.compiler.disable(_per_document)
    return {"varlen": _varlen, "flex": _flex, "dense": _dense}[backend]


def _document_block_mask(ids: torch.Tensor):
    """FlexAttention's BlockMask for causal attention within documents; ids [b, s] name each token's document."""
    def same_document_causal(b, h, q_index, kv_index):
        return (ids[b, q_index] == ids[b, kv_index]) & (q_index >= kv_index)

    # Compiled, create_block_mask evaluates the mask block by block; eager, it builds the
    # whole [b, s, s] mask first (fine for the small CPU cases that use it).
    build = _compiled(create_block_mask) if ids.is_cuda else create_block_mask
    batch, seq = ids.shape
    return build(same_document_causal, batch, None, seq, seq, device=ids.device)


@functools.cache
def _compiled(fn):
    return torch.compile(fn)


_varlen_api = None   # (varlen_attn, whether it takes GQA), once loaded


def _load_varlen():
    """torch.nn.attention.varlen's (varlen_attn, takes GQA), or None where this torch has none.
    Imported on first use, outside compiled code: the module loads torch._dynamo (about 1 s)."""
    global _varlen_api
    if _varlen_api is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:   # torch before 2.10
            return None
        # torch 2.11 wants one KV head per query head; later versions take GQA as it is.
        _varlen_api = varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters
    return _varlen_api
