"""The GPT-OSS part of ModelConfig: attention sinks, sliding windows and the clamped gated
activation, with Megatron-Core's flag names and meanings.

    --softmax-type learnable          a learned logit per head in every softmax denominator (attention
                                      sinks); off-by-one: a fixed logit 0 (TransformerConfig.softmax_type)
    --window-size 127,0               a token attends to itself and the 127 tokens before it (TE's
                                      (left, right) window; Hugging Face's sliding_window 128)
    --window-attn-skip-freq 2         which layers are windowed: N, every Nth layer (1-based) has full
                                      attention; or a list of 1 (windowed) / 0 (full) per layer
                                      (megatron.core.transformer.utils.is_layer_window_attention)
    --quick-geglu                     gated MLP with quick-GELU, x sigmoid(1.702 x), on the gate
    --glu-linear-offset 1.0           act(gate) * (up + offset)
    --activation-func-clamp-value 7   gate clamped above, up on both sides, before the activation
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tessera.config.fields import ConfigError, require
from tessera.config.moe import parse_layer_pattern

if TYPE_CHECKING:
    from tessera.config.model import ModelConfig

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def parse_window_size(text) -> tuple[int, int]:
    """--window-size "LEFT,RIGHT" (or a YAML list) -> (left, right)."""
    parts = text if isinstance(text, (list, tuple)) else str(text).strip("()[] ").split(",")
    try:
        left, right = (int(str(part).strip()) for part in parts)
    except ValueError:
        raise ConfigError(f"--window-size {text!r}: give two ints 'LEFT,RIGHT' such as '127,0'") from None
    return left, right


def window_layers(config: "ModelConfig") -> list[int | None]:
    """Per layer, its window's left size (tokens before the query it may see), or None for full attention."""
    if config.window_size is None:
        return [None] * config.num_layers
    left = config.window_size[0]
    text = config.window_attn_skip_freq
    if text is None:
        return [left] * config.num_layers
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        every = int(text)
        require(every > 0, f"--window-attn-skip-freq must be a positive int or a list expression, got {text!r}")
        return [None if (i + 1) % every == 0 else left for i in range(config.num_layers)]
    windowed = parse_layer_pattern(text, config.num_layers, flag="--window-attn-skip-freq")
    return [left if w else None for w in windowed]


def check_attention_windows(config: "ModelConfig") -> None:
    """Validate the sink and window fields (once, at construction)."""
    require(config.softmax_type in SOFTMAX_TYPES,
            f"--softmax-type must be one of {', '.join(SOFTMAX_TYPES)}, got {config.softmax_type!r}")
    if config.window_size is None:
        require(config.window_attn_skip_freq is None, "--window-attn-skip-freq needs --window-size")
    else:
        config.window_size = parse_window_size(config.window_size)
        left, right = config.window_size
        require(left >= 0 and right == 0, f"--window-size {left},{right}: attention is causal, so the window is "
                                          "'LEFT,0' with LEFT >= 0 tokens before the query")
        window_layers(config)   # checks --window-attn-skip-freq
        require(config.hybrid_layer_pattern is None, "--window-size does not apply to --hybrid-layer-pattern yet")
    if config.softmax_type != "vanilla" or config.window_size is not None:
        require(not config.multi_latent_attention,
                "--softmax-type / --window-size do not apply to --multi-latent-attention")
        # FlexAttention, their kernel on GPUs, has no dropout.
        require(config.attention_dropout == 0,
                "--attention-dropout must be 0 with --softmax-type learnable/off-by-one or --window-size")


def check_gated_activation(config: "ModelConfig") -> None:
    """Validate --quick-geglu, --glu-linear-offset and --activation-func-clamp-value."""
    require(not (config.quick_geglu and config.swiglu), "--quick-geglu and --swiglu are two gated MLPs: pick one")
    gated = config.swiglu or config.quick_geglu
    require(gated or config.glu_linear_offset == 0, "--glu-linear-offset needs a gated MLP (--swiglu or --quick-geglu)")
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        require(gated, "--activation-func-clamp-value needs a gated MLP (--swiglu or --quick-geglu)")
        require(math.isfinite(clamp) and clamp > 0, f"--activation-func-clamp-value must be positive, got {clamp}")
