"""The hybrid part of ModelConfig: Megatron-Core's layer pattern (--hybrid-layer-pattern), the
Mamba-2 mixer's shape (--mamba-*) and the Gated DeltaNet's (--linear-*), checked once at construction.

The pattern has one character per layer (megatron/core/models/hybrid/hybrid_layer_allocation.py,
`Symbols`): `M` a Mamba-2 mixer, `G` a Gated DeltaNet, `*` self-attention, `-` an MLP, `E` a Mixture of Experts, each
with its own pre-norm and residual. Its length is the number of layers (--num-layers is set
from it). `|` places pipeline-stage boundaries: the segments it cuts are the virtual pipeline
stages in Megatron's order (segment c * PP + r is chunk c of pipeline rank r), so their number
must be a multiple of --pipeline-model-parallel-size. Megatron's other symbols are refused in
one line: `D` (DeepSeek sparse attention), `+` (MLA) and `/` (MTP depths).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.config.fields import flag, positive, require

if TYPE_CHECKING:
    from tessera.config.model import ModelConfig

MAMBA, GATED_DELTANET, ATTENTION, MLP, MOE, PIPE = "M", "G", "*", "-", "E", "|"
LAYER_SYMBOLS = (MAMBA, GATED_DELTANET, ATTENTION, MLP, MOE)
_NOT_YET = {"D": "D (DeepSeek sparse attention) is not supported",
            "+": "+ (MLA) is not supported in a hybrid pattern", "/": "/ (MTP depths) is not supported yet"}


def layer_symbols(pattern: str) -> list[str]:
    """One symbol per layer: the pattern without its pipeline boundaries."""
    return [symbol for symbol in pattern if symbol != PIPE]


def stage_ranges(pattern: str, pp_size: int) -> list[range] | None:
    """Global layer indices of each virtual pipeline stage that `|` marks; None without `|`."""
    segments = pattern.split(PIPE)
    if len(segments) == 1:
        return None
    require(len(segments) % pp_size == 0,
            f"--hybrid-layer-pattern has {len(segments)} pipeline segments (cut by '|'), which must be a multiple "
            f"of --pipeline-model-parallel-size ({pp_size})")
    require(all(segments), "--hybrid-layer-pattern: every segment between '|' needs at least one layer")
    starts = [sum(len(s) for s in segments[:i]) for i in range(len(segments))]
    return [range(start, start + len(segment)) for start, segment in zip(starts, segments)]


def apply_pattern(config: "ModelConfig") -> None:
    """Validate the pattern (or its deprecated spelling) and set num_layers from it."""
    legacy = config.hybrid_override_pattern
    if legacy is not None:   # Megatron's deprecated spelling, forwarded as Megatron forwards it
        require(config.hybrid_layer_pattern in (None, legacy),
                "--hybrid-override-pattern (deprecated) and --hybrid-layer-pattern differ: give one of them")
        config.hybrid_layer_pattern, config.hybrid_override_pattern = legacy, None
    pattern = config.hybrid_layer_pattern
    if pattern is None:
        return
    for symbol, reason in _NOT_YET.items():
        require(symbol not in pattern, f"--hybrid-layer-pattern {pattern!r}: {reason}")
    unknown = sorted(set(pattern) - set(LAYER_SYMBOLS) - {PIPE})
    require(not unknown, f"--hybrid-layer-pattern {pattern!r}: unknown symbol(s) {' '.join(unknown)}; use "
                         "M (Mamba-2), G (Gated DeltaNet), * (attention), - (MLP), E (MoE) and | (pipeline boundary)")
    symbols = layer_symbols(pattern)
    require(symbols, "--hybrid-layer-pattern needs at least one layer")
    config.num_layers = len(symbols)


def check_hybrid(config: "ModelConfig") -> None:
    """The layers' kinds against the other flags, and the Mamba-2 and Gated DeltaNet shapes; sets
    mamba_num_heads's default (2 x hidden / head dim: Megatron's expand of 2)."""
    positive(config, "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
             "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")
    require(config.linear_num_value_heads % config.linear_num_key_heads == 0,
            f"--linear-num-value-heads ({config.linear_num_value_heads}) must be a multiple of "
            f"--linear-num-key-heads ({config.linear_num_key_heads})")
    if config.hybrid_layer_pattern is None:
        return
    symbols = layer_symbols(config.hybrid_layer_pattern)
    require(MOE not in symbols or config.num_experts is not None, "--hybrid-layer-pattern with E needs --num-experts")
    require(config.num_experts is None or MOE in symbols,
            "--num-experts with --hybrid-layer-pattern needs E layers in the pattern")
    require(config.moe_layer_freq == "1", "--moe-layer-freq does not apply with --hybrid-layer-pattern (E marks "
                                          "the MoE layers)")
    require(not config.mtp_num_layers, "--mtp-num-layers with --hybrid-layer-pattern is not supported yet")
    if MAMBA not in symbols:
        return
    if config.mamba_num_heads is None:
        require(2 * config.hidden_size % config.mamba_head_dim == 0,
                f"2 x --hidden-size ({config.hidden_size}) must be divisible by --mamba-head-dim "
                f"({config.mamba_head_dim}), or give --mamba-num-heads")
        config.mamba_num_heads = 2 * config.hidden_size // config.mamba_head_dim
    require(config.mamba_num_heads % config.mamba_num_groups == 0,
            f"--mamba-num-heads ({config.mamba_num_heads}) must be divisible by --mamba-num-groups "
            f"({config.mamba_num_groups})")


def check_hybrid_layout(config: "ModelConfig", *, tp: int, cp: int) -> None:
    """What tensor and context parallelism ask of the Mamba-2 and Gated DeltaNet layers (Megatron's
    MambaMixer and GatedDeltaNet asserts)."""
    pattern = config.hybrid_layer_pattern or ""
    mixers = {MAMBA: ("mamba_num_heads", "mamba_num_groups", "Mamba", "the scan"),
              GATED_DELTANET: ("linear_num_key_heads", "linear_num_value_heads", "Gated DeltaNet", "the delta rule")}
    for symbol, (*names, layers, recurrence) in mixers.items():
        if symbol not in pattern:
            continue
        for name in names:
            require(getattr(config, name) % tp == 0, f"{flag(name)} ({getattr(config, name)}) must be divisible by "
                                                     f"--tensor-model-parallel-size ({tp})")
        require(cp == 1, f"--context-parallel-size > 1 with {layers} layers ({symbol} in --hybrid-layer-pattern) is "
                         f"not supported yet: {recurrence} would need the state passed between context-parallel ranks")
