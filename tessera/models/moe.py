"""The Mixture-of-Experts layer: router, token dispatch, experts, shared expert.

    routing, aux_loss = router(tokens)                # which experts, with what weights
    rows = dispatcher.dispatch(tokens, routing)       # tokens to the ranks and experts that own them
    out = dispatcher.combine(experts(rows), rows)     # expert outputs back on their tokens, summed
    out += shared_expert(x)                           # optional, every token (Qwen2-MoE, DeepSeek)

The dispatchers live in tessera.parallel.experts (they are the expert parallelism); the
router and its load-balancing losses in tessera.models.router. The experts of a rank are
stacked weights [local experts, out, in] (the layout of Hugging Face's fused experts), run
in two grouped GEMMs (--moe-grouped-gemm: tessera.kernels.grouped_gemm) or a loop over experts; with
--fp8-experts, in two FP8 grouped GEMMs (tessera.kernels.fp8_grouped) either way.
Routing weights scale each row after the activation, before fc2, as Megatron does; with
biases (MoE without --disable-bias-linear: GPT-OSS) each row's fc1 bias is added before the
activation and its fc2 bias, weighted by the row's routing weight, after fc2 (Megatron's
TEGroupedMLP._apply_bias).

The load-balancing losses enter the gradient through `_AttachAuxLoss`: the layer's output
passes through unchanged, and in backward the loss receives `aux_loss_scale` (set by the
trainer, tessera.training.losses) as its gradient, exactly as if it had been added to the
objective with that weight. So the losses need no path of their own through pipeline
stages, recomputation or compiled blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.fp8 import Fp8Recipe
from tessera.kernels.fp8_grouped import fp8_grouped_linear, padded_groups
from tessera.kernels.gelu import gelu
from tessera.kernels.grouped_gemm import grouped_linear
from tessera.kernels.squared_relu import squared_relu
from tessera.kernels.swiglu import weighted_swiglu
from tessera.models.gated_activation import gated_activation
from tessera.models.mlp import MLP
from tessera.models.router import Router
from tessera.parallel.experts import ExpertGroups, build_dispatcher
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size


class MoELayer(nn.Module):
    """A MoE MLP: routed experts (split over expert-parallel ranks) and an optional shared expert."""

    def __init__(self, config: ModelConfig, output_std: float, *, tp_group=None, sequence_parallel: bool = False,
                 groups: ExpertGroups | None = None):
        super().__init__()
        groups = groups or ExpertGroups()
        self.router = Router(config, tp_group=tp_group, sequence_parallel=sequence_parallel,
                             loss_group=groups.loss, global_group=groups.stage)
        self.dispatcher = build_dispatcher(groups, config.num_experts)
        self.experts = GroupedExperts(config, output_std, groups=groups)
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = MLP(config, output_std, tp_group=tp_group, sequence_parallel=sequence_parallel,
                                 ffn_hidden_size=shared, ffn_flag="--moe-shared-expert-intermediate-size") \
            if shared else None
        if config.moe_shared_expert_gate:
            tp_rank, tp_size = rank_and_size(tp_group)
            shape = (1, config.hidden_size)
            self.shared_expert_gate = annotate(nn.Parameter(torch.empty(shape)),
                                               ShardSpec(shape, None, None, tp_rank, tp_size),
                                               init_std=config.init_method_std, sequence_parallel=sequence_parallel)
        else:
            self.shared_expert_gate = None
        self.register_buffer("aux_loss_scale", torch.ones(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, hidden] (a sequence shard under SP) -> the same shape."""
        tokens = x.reshape(-1, x.shape[-1])
        routing, aux_loss = self.router(tokens, batch_size=x.shape[0])
        rows = self.dispatcher.dispatch(tokens.to(compute_dtype(x)), routing)
        out = self.dispatcher.combine(self.experts(rows.hidden, rows.tokens_per_expert, rows.probs), rows)
        out = out.view(*x.shape[:-1], -1)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_expert_gate))
            out = out + shared
        if aux_loss is not None:
            out = _AttachAuxLoss.apply(out, aux_loss, self.aux_loss_scale)
        return out


class GroupedExperts(nn.Module):
    """This rank's routed experts: fc1 [local experts, (2 x) ffn / ETP, hidden], fc2 [local, hidden, ffn / ETP].

    With expert tensor parallelism each rank holds a column slice of every fc1 (gate and up
    cut alike) and the matching row slice of fc2, so its outputs are partial sums that the
    dispatcher's combine reduces.
    """

    def __init__(self, config: ModelConfig, output_std: float, *, groups: ExpertGroups):
        super().__init__()
        ep_rank, ep_size = rank_and_size(groups.ep)
        etp_rank, etp_size = rank_and_size(groups.etp)
        experts, hidden, ffn = config.num_experts, config.hidden_size, config.moe_ffn_hidden_size
        self.swiglu, self.openai_gelu, self.grouped_gemm = config.swiglu, config.openai_gelu, config.moe_grouped_gemm
        self.squared_relu = config.squared_relu
        self.gated_activation = gated_activation(config)
        gated = config.gated_linear_unit
        fc1_rows = 2 * ffn if gated else ffn
        cut = dict(rank=etp_rank, size=etp_size, expert_rank=ep_rank, expert_size=ep_size)
        fc1_spec = ShardSpec((experts, fc1_rows, hidden), 1, (ffn, ffn) if gated else None, **cut)
        fc2_spec = ShardSpec((experts, hidden, ffn), 2, None, **cut)
        local = experts // ep_size
        self.fc1 = annotate(nn.Parameter(torch.empty(local, fc1_rows // etp_size, hidden)), fc1_spec,
                            init_std=config.init_method_std, is_expert=True)
        self.fc2 = annotate(nn.Parameter(torch.empty(local, hidden, ffn // etp_size)), fc2_spec,
                            init_std=output_std, is_expert=True)
        if config.add_bias_linear:   # zeros at first (Megatron's and transformers' init); never cut by ETP
            experts_cut = dict(expert_rank=ep_rank, expert_size=ep_size)
            self.fc1_bias = annotate(nn.Parameter(torch.empty(local, fc1_rows)),
                                     ShardSpec((experts, fc1_rows), **experts_cut), is_expert=True)
            self.fc2_bias = annotate(nn.Parameter(torch.empty(local, hidden)),
                                     ShardSpec((experts, hidden), **experts_cut), is_expert=True)
        else:
            self.fc1_bias = self.fc2_bias = None
        self.fp8: Fp8Recipe | None = None   # set by --fp8-experts (tessera.training.fp8)
        # LoRA adapters of fc1 and fc2 (tessera.posttrain.lora): `adapter(x, y, gemm)` adds the update of
        # the rows x to the GEMM's output y, through the same grouped GEMM.
        self.fc1_adapter = self.fc2_adapter = None

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Rows x [N, hidden] grouped by expert (`tokens_per_expert` of them each), weighted by probs [N]."""
        dtype = x.dtype
        fc1, fc2 = self.fc1.to(dtype), self.fc2.to(dtype)
        if self.fp8 is not None:
            if self.fc1_adapter is not None or self.fc2_adapter is not None:
                raise ConfigError("--fp8-experts does not combine with LoRA adapters on the experts "
                                  "(--lora-target-modules, --lora-exclude-modules)")
            if self.fc1_bias is not None:
                raise ConfigError("--fp8-experts does not support expert biases yet (add --disable-bias-linear)")
            return self._fp8_forward(x, tokens_per_expert, probs, fc1, fc2)
        if self.grouped_gemm and grouped_mm_available(x.device.type, dtype):
            bounds = F.pad(torch.cumsum(tokens_per_expert, 0), (1, 0)).to(torch.int32)

            def gemm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return grouped_linear(rows, weight, bounds)
        else:
            sizes = tokens_per_expert.tolist()   # a host sync: the loop needs the sizes

            def gemm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return torch.cat([F.linear(group, w) for group, w in zip(rows.split(sizes), weight)])
        if self.fc1_bias is None:
            hidden = self._weighted_activation(_adapted(gemm, x, fc1, self.fc1_adapter), probs)
            return _adapted(gemm, hidden, fc2, self.fc2_adapter)
        expert = torch.repeat_interleave(torch.arange(len(fc1), device=x.device), tokens_per_expert,
                                         output_size=x.shape[0])   # each row's local expert
        hidden = _adapted(gemm, x, fc1, self.fc1_adapter) + self.fc1_bias.to(dtype)[expert]
        out = _adapted(gemm, self._weighted_activation(hidden, probs), fc2, self.fc2_adapter)
        return out + (self.fc2_bias[expert] * probs.unsqueeze(-1)).to(dtype)

    def _fp8_forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                     fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
        """Both GEMMs in FP8 (tessera.kernels.fp8_grouped), on the rows laid out with every
        expert's group padded to a multiple of 16 rows: zero rows, weight 0, output dropped."""
        where, ends, total = padded_groups(tokens_per_expert, x.shape[0])
        padded = x.new_zeros(total, x.shape[1]).index_copy(0, where, x)
        padded_probs = probs.new_zeros(total).index_copy(0, where, probs)
        wgrad = self.fp8.fp8_wgrad
        hidden = self._weighted_activation(fp8_grouped_linear(padded, fc1, ends, wgrad), padded_probs)
        return fp8_grouped_linear(hidden, fc2, ends, wgrad).index_select(0, where)

    def _weighted_activation(self, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        # In fp32, back to the GEMMs' dtype: SwiGLU by one kernel each way, GeLU and squared ReLU as a
        # compiled block fuses them.
        if self.gated_activation is not None:
            return (self.gated_activation(hidden.to(probs.dtype)) * probs.unsqueeze(-1)).to(hidden.dtype)
        if self.swiglu:
            return weighted_swiglu(hidden, probs)
        act = squared_relu(hidden.float()) if self.squared_relu else gelu(hidden.float(), tanh=self.openai_gelu)
        out = act * probs.unsqueeze(-1)
        return out.to(hidden.dtype)


def _adapted(gemm, x: torch.Tensor, weight: torch.Tensor, adapter) -> torch.Tensor:
    y = gemm(x, weight)
    return y if adapter is None else adapter(x, y, gemm)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activation; backward gives `aux_loss` the gradient `scale`, as if
    scale x aux_loss had been added to the loss being backpropagated (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, hidden, aux_loss, scale):
        ctx.save_for_backward(scale)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad, scale.detach().clone(), None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype GEMMs run in here: autocast's, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


def grouped_mm_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here: bf16 on CUDA; on CPU from torch 2.9 (no CPU kernel
    before), where torch.compile traces it in bf16 only. Elsewhere the experts loop, which
    computes the same (a pure rule rather than a probe, so that a compiled block can fold it)."""
    if not hasattr(torch, "_grouped_mm") or device_type not in ("cuda", "cpu"):
        return False
    if dtype == torch.bfloat16:
        return device_type == "cuda" or _TORCH_VERSION >= (2, 9)
    return device_type == "cpu" and _TORCH_VERSION >= (2, 9) and dtype == torch.float32 \
        and not torch.compiler.is_compiling()
