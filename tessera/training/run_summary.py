"""The lines a run logs before its first iteration: what is trained, where, and in what layout."""

from __future__ import annotations

import torch

from tessera.config import RunConfig
from tessera.parallel.mesh import Mesh
from tessera.perf.flops import count_parameters


def run_summary(config: RunConfig, mesh: Mesh, device: torch.device, vocab_size: int, optimizer) -> list[str]:
    """The model's size, the layout, precision and batch, the optimizer state per rank (and how much
    of it is in host memory), then the config's notes."""
    params = count_parameters(config.model, vocab_size)
    active = f", {params.active / 1e6:.1f}M active per token" if params.inactive else ""
    experts = f" EP {mesh.ep_size} ETP {mesh.etp_size}" if config.model.num_experts else ""
    train = config.train
    lines = [
        f"tessera: {params.total / 1e6:.1f}M parameters ({params.non_embedding / 1e6:.1f}M non-embedding{active}) | "
        f"{mesh.world_size} x {device.type} | TP {mesh.tp_size} CP {mesh.cp_size} DP {mesh.dp_size} "
        f"PP {mesh.pp_size}{experts} | {train.dtype_name} | global batch {train.global_batch_size} = "
        f"{config.num_micro_batches} micro-batches x {train.micro_batch_size} x DP {mesh.dp_size} "
        f"| seq {config.model.seq_length} | optimizer state {_optimizer_state(optimizer)}",
        *config.notes,
    ]
    if train.attention_backend != "auto" and device.type != "cuda":
        lines.append(f"note: --attention-backend {train.attention_backend} chooses among CUDA kernels; on "
                     f"{device.type} SDPA runs its {device.type} kernel")
    return lines


def _optimizer_state(optimizer) -> str:
    total, host = optimizer.state_bytes() / 2**30, optimizer.host_state_bytes() / 2**30
    where = f" ({host:.3f} GiB of it in host memory)" if host else ""
    return f"{total:.3f} GiB/rank{where}"
