"""Mamba-2's selective state-space scan (SSD: "Transformers are SSMs", arXiv 2405.21060), in chunks.

    y = ssd_scan(x, dt, A, B, C, D, document_ids=ids)
    y, final = ssd_scan(x, dt, A, B, C, D, initial_states=h0, return_final_states=True)   # generation
    y, h = ssd_step(h, x_t, dt_t, A, B_t, C_t, D)                                     # one token

Per head, with state h [P, N] starting at zero (and again at the first token of every document):

    h_t = exp(dt_t * A) h_{t-1} + dt_t * x_t B_t^T        y_t = h_t C_t + D x_t

x [b, s, heads, P], dt [b, s, heads] (after softplus), A [heads] (negative), B and C
[b, s, groups, N] shared by the heads of a group (heads // groups of them, in order), D [heads];
`document_ids` [b, s] (optional) names each token's document: no state crosses from one to the next.
`initial_states` [b, heads, P, N] (optional) is the state before the first token, carried into its
document; `return_final_states` also returns the state after the last token (of its document), in
fp32 (or fp64): what the inference engine keeps per request between a prompt's chunks, and what
`ssd_step` advances one token at a time while it decodes (mamba_ssm's names for the same).

Backends (`BACKENDS`; `default_backend` picks one):
- "torch": the chunked algorithm of the paper's Listing 1 in PyTorch ops, computed in fp32 (or fp64). Inside a
  chunk of `chunk_size` tokens the scan is a masked matrix product (quadratic in the chunk);
  each chunk's final state passes to the next in a loop over chunks. Documents are masks: a
  token sees the tokens and carried state of its own document only. It runs anywhere, is the
  CPU oracle (tests check it against the fp64 recurrence), and is the default.
- "mamba_ssm": the Triton kernel of the `mamba-ssm` package (`mamba_chunk_scan_combined`,
  documents as its `seq_idx`), on CUDA where that package is installed. Not measured against
  the PyTorch path yet, so it is chosen by name only (a benchmark's), never by default.
"""

from __future__ import annotations

import functools

import torch

from tessera.kernels.precision import without_autocast

BACKENDS = ("torch", "mamba_ssm")
CHUNK_SIZE = 128   # Megatron's MambaMixer default


def default_backend(x: torch.Tensor) -> str:
    """The scan kernel for `x`'s device: PyTorch's everywhere until the Triton kernel is measured
    beside it on a GPU (bench/ would time both by name)."""
    return "torch"


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, *, document_ids: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
             backend: str | None = None, initial_states: torch.Tensor | None = None,
             return_final_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y [b, s, heads, P] in x's dtype, and with `return_final_states` the state after the last
    token [b, heads, P, N] (see the module docstring)."""
    backend = backend or default_backend(x)
    if backend == "mamba_ssm":
        return _mamba_ssm(x, dt, A, B, C, D, document_ids, chunk_size, initial_states, return_final_states)
    if backend != "torch":
        raise ValueError(f"SSD backend '{backend}': choose one of {', '.join(BACKENDS)}")
    y, final = _chunked(x, dt, A, B, C, D, document_ids, chunk_size, initial_states)
    return (y, final) if return_final_states else y


@without_autocast
def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence for one token of each row, no scan: state [rows, heads, P, N], x [rows, heads, P],
    dt [rows, heads], B and C [rows, groups, N] -> (y [rows, heads, P] in x's dtype, the next state in
    the state's dtype)."""
    dtype = state.dtype
    per_group = x.shape[1] // B.shape[1]
    B, C = (t.to(dtype).repeat_interleave(per_group, dim=1) for t in (B, C))   # [rows, heads, N]
    dt, inputs = dt.to(dtype), x.to(dtype)
    state = state * (dt * A.to(dtype)).exp()[..., None, None] + (dt[..., None] * inputs)[..., None] * B[:, :, None]
    y = (state @ C[..., None])[..., 0] + D.to(dtype)[:, None] * inputs
    return y.to(x.dtype), state


@without_autocast
def _chunked(x, dt, A, B, C, D, document_ids, chunk_size: int, initial_states) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, _ = x.shape
    per_group = heads // B.shape[2]
    if document_ids is None:
        document_ids = torch.zeros(batch, seq, dtype=torch.int32, device=x.device)
    pad = -seq % chunk_size   # zeros at the end: later tokens never reach earlier outputs
    chunks = (seq + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:   # [b, s, ...] -> [b, chunks, chunk_size, ...]
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(batch, chunks, chunk_size, *t.shape[2:])

    dtype = torch.promote_types(x.dtype, torch.float32)   # fp32 at least; fp64 stays fp64 (the tests)
    xs, dts = chunked(x.to(dtype)), chunked(dt.to(dtype))
    Bs, Cs = (chunked(t.to(dtype).repeat_interleave(per_group, dim=2)) for t in (B, C))  # [b, c, l, heads, N]
    # The padding joins the last document (dt 0: it changes no state): the final state is that document's.
    ids = torch.cat([document_ids, document_ids[:, -1:].expand(batch, pad)], dim=1).view(batch, chunks, chunk_size)
    log_decay = (dts * A.to(dtype)).cumsum(dim=2)   # [b, c, l, heads]: sum of dt * A from the chunk's start
    inputs = xs * dts.unsqueeze(-1)               # dt_t x_t

    # 1. Within each chunk: y_i = sum over j <= i in i's document of (C_i . B_j) exp(sum_{j<k<=i} dt A) dt_j x_j.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    visible = (ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal                       # [b, c, i, j]
    gaps = log_decay.unsqueeze(3) - log_decay.unsqueeze(2)                            # [b, c, i, j, heads]
    weights = torch.einsum("bcihn,bcjhn->bcijh", Cs, Bs) * gaps.masked_fill(~visible.unsqueeze(-1), -torch.inf).exp()
    y = torch.einsum("bcijh,bcjhp->bcihp", weights, inputs)

    # 2. Each chunk's own contribution to the state at its last token (that token's document only).
    last_ids = ids[:, :, -1]
    to_end = (log_decay[:, :, -1:] - log_decay).exp() * (ids == last_ids.unsqueeze(-1)).unsqueeze(-1)
    own = torch.einsum("bclhn,bclh,bclhp->bchpn", Bs, to_end, inputs)                # [b, c, heads, P, N]

    # 3. The state entering each chunk: the previous one's, carried on while the document goes on. The
    # document running as a chunk starts: the previous chunk's last; before the first, the initial
    # state's (the first token's) or none.
    before = ids[:, :1, 0] if initial_states is not None else torch.full_like(last_ids[:, :1], -1)
    previous_ids = torch.cat([before, last_ids[:, :-1]], dim=1)                       # [b, c]
    carried = log_decay[:, :, -1].exp() * (last_ids == previous_ids).unsqueeze(-1)
    state = initial_states.to(dtype) if initial_states is not None else torch.zeros_like(own[:, 0])
    entering = []
    for chunk in range(chunks):
        entering.append(state)
        state = own[:, chunk] + state * carried[:, chunk, :, None, None]
    entering = torch.stack(entering, dim=1)                                           # [b, c, heads, P, N]

    # 4. What the entering state gives each token of the chunk's first document.
    from_start = log_decay.exp() * (ids == previous_ids.unsqueeze(-1)).unsqueeze(-1)
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", Cs, entering, from_start)
    y = y.reshape(batch, chunks * chunk_size, heads, -1)[:, :seq]
    return (y + D.to(dtype)[:, None] * x.to(dtype)).to(x.dtype), state


@functools.cache
def _mamba_ssm_kernel():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return mamba_chunk_scan_combined


def _mamba_ssm(x, dt, A, B, C, D, document_ids, chunk_size: int, initial_states, return_final_states: bool):
    kernel = _mamba_ssm_kernel() if x.is_cuda else None
    if kernel is None:
        raise ValueError("SSD backend 'mamba_ssm' needs CUDA and the mamba-ssm package (pip install mamba-ssm "
                         "--no-build-isolation)")
    seq_idx = None if document_ids is None else document_ids.to(torch.int32).contiguous()
    return kernel(x, dt, A, B, C, chunk_size, D=D, seq_idx=seq_idx, initial_states=initial_states,
                  return_final_states=return_final_states)
