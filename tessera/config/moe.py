"""The Mixture-of-Experts part of ModelConfig: which layers are MoE, and the checks that
make a router able to do what its flags ask (Megatron-Core's semantics and flag names)."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from tessera.config.fields import ConfigError, flag, require

if TYPE_CHECKING:
    from tessera.config.model import ModelConfig

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def parse_layer_pattern(text: str | int, num_layers: int, flag: str = "--moe-layer-freq") -> list[bool]:
    """--moe-layer-freq: an int N (layer i is MoE iff i % N == 0, Megatron's rule) or a list
    expression of 0/1 per layer such as "([0]*1+[1]*23)" (DeepSeek's dense first layer);
    `flag` names the option in errors (--window-attn-skip-freq takes the same lists)."""
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        every = int(text)
        require(every > 0, f"{flag} must be a positive int or a list expression, got {text!r}")
        return [i % every == 0 for i in range(num_layers)]
    try:
        pattern = _evaluate_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        raise ConfigError(f"{flag} {text!r}: not an int or a list expression of 0s and 1s "
                          f"such as '([0]*1+[1]*23)' ({exc})") from None
    require(all(v in (0, 1) for v in pattern), f"{flag} {text!r}: entries must be 0 or 1")
    require(len(pattern) == num_layers,
            f"{flag} {text!r} gives {len(pattern)} layers, --num-layers is {num_layers}")
    return [bool(v) for v in pattern]


def _evaluate_list(node: ast.AST) -> list[int]:
    """Lists of ints, joined with + and repeated with * by an int: nothing else is evaluated."""
    if isinstance(node, ast.List):
        values = [element.value for element in node.elts if isinstance(element, ast.Constant)]
        if len(values) != len(node.elts) or not all(isinstance(v, int) for v in values):
            raise ValueError("list entries must be ints")
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _evaluate_list(node.left) + _evaluate_list(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        lists = [n for n in (node.left, node.right) if not isinstance(n, ast.Constant)]
        counts = [n.value for n in (node.left, node.right) if isinstance(n, ast.Constant)]
        if len(lists) == 1 and len(counts) == 1 and isinstance(counts[0], int):
            return _evaluate_list(lists[0]) * counts[0]
    raise ValueError(f"unexpected {type(node).__name__}")


# Fields that only mean something with --num-experts, and their defaults.
_MOE_ONLY = {
    "moe_ffn_hidden_size": None, "moe_router_topk": 2, "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_router_enable_expert_bias": False, "moe_router_dtype": None,
    "moe_z_loss_coeff": None, "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False, "moe_layer_freq": "1",
    "moe_grouped_gemm": False,
}


def check_moe(config: "ModelConfig") -> None:
    """Validate the MoE fields of `config` (once, at construction); fill moe_ffn_hidden_size."""
    if config.num_experts is None:
        for name, default in _MOE_ONLY.items():
            require(getattr(config, name) == default, f"{flag(name)} needs --num-experts")
        require(not any(config.moe_aux_loss_coeff), "--moe-aux-loss-coeff needs --num-experts")
        return
    experts, topk = config.num_experts, config.moe_router_topk
    require(experts > 0 and topk > 0, "--num-experts and --moe-router-topk must be positive")
    require(topk <= experts, f"--moe-router-topk ({topk}) must not exceed --num-experts ({experts})")
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size   # Megatron's fallback
    require(config.moe_ffn_hidden_size > 0, "--moe-ffn-hidden-size must be positive")
    config.moe_layers()   # checks --moe-layer-freq
    _check_router(config)
    _check_load_balancing(config)
    capacity = config.moe_expert_capacity_factor
    require(capacity is None or capacity > 0, f"--moe-expert-capacity-factor must be positive, got {capacity}")
    require(not config.moe_pad_expert_input_to_capacity or capacity is not None,
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    shared = config.moe_shared_expert_intermediate_size
    require(shared is None or shared > 0, "--moe-shared-expert-intermediate-size must be positive")
    require(not config.moe_shared_expert_gate or shared is not None,
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")


def _check_router(config: "ModelConfig") -> None:
    experts, topk = config.num_experts, config.moe_router_topk
    sigmoid = config.moe_router_score_function == "sigmoid"
    require(not (sigmoid and config.moe_router_pre_softmax),
            "--moe-router-pre-softmax needs --moe-router-score-function softmax")
    require(not config.moe_router_enable_expert_bias or sigmoid,
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    require(config.moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate must be >= 0")
    scaling = config.moe_router_topk_scaling_factor
    require(scaling is None or scaling > 0, f"--moe-router-topk-scaling-factor must be positive, got {scaling}")
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    require((groups is None) == (group_topk is None),
            "--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is None:
        return
    require(groups > 0 and group_topk > 0, "--moe-router-num-groups and --moe-router-group-topk must be positive")
    require(experts % groups == 0, f"--num-experts ({experts}) must be divisible by --moe-router-num-groups ({groups})")
    require(group_topk <= groups,
            f"--moe-router-group-topk ({group_topk}) must not exceed --moe-router-num-groups ({groups})")
    # A group's score is the sum of its top (topk // group_topk) experts, and the kept groups
    # must hold at least topk experts.
    require(topk >= group_topk and group_topk * (experts // groups) >= topk,
            f"--moe-router-group-topk ({group_topk}) groups of {experts // groups} experts cannot supply "
            f"--moe-router-topk ({topk}) experts (need group_topk <= topk <= group_topk x experts per group)")


def _check_load_balancing(config: "ModelConfig") -> None:
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    require(len(kinds) > 0 and all(k in LOAD_BALANCING_TYPES for k in kinds),
            f"--moe-router-load-balancing-type must be among {', '.join(LOAD_BALANCING_TYPES)}, got {kinds}")
    require(len(set(kinds)) == len(kinds), f"--moe-router-load-balancing-type lists a type twice: {kinds}")
    require(len(coeffs) in (1, len(kinds)),
            f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(kinds)} --moe-router-load-balancing-type")
    require(all(c >= 0 for c in coeffs), "--moe-aux-loss-coeff must be >= 0")
    require(config.moe_z_loss_coeff is None or config.moe_z_loss_coeff >= 0, "--moe-z-loss-coeff must be >= 0")


def check_expert_layout(config: "ModelConfig", *, tp: int, cp: int, dp: int, ep: int, etp: int,
                        sequence_parallel: bool) -> None:
    """Expert parallelism re-slices each stage's TP x CP x DP ranks as EDP x EP x ETP (Megatron's
    folding): the trainer's rules, shared with the planner."""
    if config.num_experts is None:
        require(ep == 1 and etp == tp, "--expert-model-parallel-size / --expert-tensor-parallel-size need --num-experts")
        return
    require(min(ep, etp) >= 1, "--expert-model-parallel-size and --expert-tensor-parallel-size must be positive")
    stage_ranks = tp * cp * dp
    require(stage_ranks % (ep * etp) == 0,
            f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) must divide "
            f"--tensor-model-parallel-size x --context-parallel-size x data-parallel size ({stage_ranks})")
    require(config.num_experts % ep == 0,
            f"--num-experts ({config.num_experts}) must be divisible by --expert-model-parallel-size ({ep})")
    require(config.moe_ffn_hidden_size % etp == 0,
            f"--moe-ffn-hidden-size ({config.moe_ffn_hidden_size}) must be divisible by "
            f"--expert-tensor-parallel-size ({etp})")
    require(etp == 1 or not config.add_bias_linear,
            "expert biases (MoE without --disable-bias-linear) need --expert-tensor-parallel-size 1, as in Megatron")
    # Each TP rank must route its own tokens, or experts would see every token TP times.
    require(tp == 1 or sequence_parallel, "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel")


def aux_loss_coefficients(config: "ModelConfig") -> dict[str, float]:
    """{load-balancing type: coefficient} of the losses that are on (coefficient > 0)."""
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    coeffs = coeffs * len(kinds) if len(coeffs) == 1 else coeffs
    return {kind: coeff for kind, coeff in zip(kinds, coeffs) if kind != "none" and coeff > 0}
