"""The sum of squares of many tensors in one kernel launch: the gradient norm's pass.

torch._foreach_norm reads a step's bf16 gradients at about half the HBM rate on an H200
(config M: 3.25 ms for 7.8 GB), and one Triton launch per tensor costs more host time than
it saves (docs/performance-notes.md). This kernel takes the tensors' addresses from a table, so
one launch covers every tensor of a dtype: each program sums CHUNK elements of one tensor
into its own fp32 partial, and the partials are added in a fixed order (the result does not
depend on scheduling). The addresses go up from pinned memory each step, so the host never
waits for the GPU here. Elsewhere (CPU, no Triton) torch._foreach_norm computes the same.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

BLOCK, CHUNK, NUM_WARPS = 1024, 8192, 4   # elements per load, per program; the fastest on an H200 (config M's gradients)


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum over the tensors of sum(t^2), in fp32, as a 0-d tensor on their device."""
    device = tensors[0].device
    if triton is None or device.type != "cuda":
        return _by_foreach_norm(tensors)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor.contiguous())
    return sum(_one_launch(group, device) if dtype in _TRITON_DTYPES else _by_foreach_norm(group)
               for dtype, group in by_dtype.items())


def _by_foreach_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


_programs: dict[tuple[int, ...], torch.Tensor] = {}   # by the tensors' sizes, which repeat every step


def chunk_programs(sizes: list[int] | tuple[int, ...], chunk: int) -> torch.Tensor:
    """The programs of a launch over many tensors, `chunk` elements each: row 0 which tensor (a
    row of the address table), row 1 which chunk of it."""
    chunks = torch.tensor([-(-n // chunk) for n in sizes], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(sizes)), chunks)
    first = torch.arange(len(owner)) - torch.repeat_interleave(chunks.cumsum(0) - chunks, chunks)
    return torch.stack([owner, first])


def _one_launch(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    sizes = tuple(t.numel() for t in tensors)
    if sizes not in _programs:
        if len(_programs) >= 8:
            _programs.clear()
        _programs[sizes] = chunk_programs(sizes, CHUNK).to(device=device, dtype=torch.int32)
    programs = _programs[sizes]
    # Gradients move between steps (the allocator's order varies), so their addresses are
    # sent every step, from pinned memory: no wait for the GPU.
    addresses = torch.tensor([(t.data_ptr(), n) for t, n in zip(tensors, sizes)], dtype=torch.int64)
    addresses = addresses.pin_memory().to(device, non_blocking=True)
    partials = torch.empty(programs.shape[1], dtype=torch.float32, device=device)
    _sum_of_squares_kernel[(programs.shape[1],)](
        addresses, programs, partials, programs.shape[1], DTYPE=_TRITON_DTYPES[tensors[0].dtype],
        BLOCK=BLOCK, CHUNK=CHUNK, num_warps=NUM_WARPS)
    return partials.sum()


if triton is not None:
    _TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _sum_of_squares_kernel(addresses, programs, partials, n_programs, DTYPE: tl.constexpr,
                               BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        tensor = tl.load(programs + pid)
        chunk = tl.load(programs + n_programs + pid).to(tl.int64)
        base = tl.load(addresses + 2 * tensor).to(tl.pointer_type(DTYPE))
        n = tl.load(addresses + 2 * tensor + 1)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, CHUNK, BLOCK):
            offsets = chunk * CHUNK + start + tl.arange(0, BLOCK)
            x = tl.load(base + offsets, mask=offsets < n, other=0.0).to(tl.float32)
            acc += x * x
        tl.store(partials + pid, tl.sum(acc, axis=0))
