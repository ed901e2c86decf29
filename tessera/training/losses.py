"""The training objective, in one place: the LM loss over the global batch's tokens, plus
the multi-token-prediction losses and every MoE layer's load-balancing losses with
Megatron's weights.

LM: each rank backpropagates its micro-batch's masked per-token loss sum x loss scale /
the unmasked tokens of the whole global batch. Summed over ranks and micro-batches that is
the gradient of the token mean, whatever the layout.

MTP (--mtp-num-layers D): depth k's masked per-token losses (its mask: the LM's, shifted
with the targets, tessera.models.mtp.depth_loss_mask) join the same sum with the weight
--mtp-loss-scaling-factor / D, over the same tokens as the LM loss:

    objective = (sum of LM losses + factor / D x sum over depths of depth-k losses) / LM tokens

(Megatron's weight, and its normalisation under --calculate-per-token-loss, which is how
tessera normalises the LM loss.) The reported LM loss leaves them out; each depth is
logged as 'mtp_k loss', its mean over its own targets (`LossTerms`).

MoE: each router computes its micro-batch's load-balancing losses times their
coefficients (its rank's part of them; the parts add up over the ranks sharing the
micro-batch). As Megatron's default does, the objective adds each MoE layer's mean over
the step's micro-batches:

    objective = LM token mean + sum over MoE layers of mean over micro-batches of (coeff x loss)

so each part's gradient weight is loss scale / (micro-batches per rank x DP ranks),
set on every MoE layer before the step (`MoEBalance.set_loss_scale`). Neither TP, CP, PP
nor the number of micro-batches changes it.

After the step's backward, `MoEBalance.finish_step` sums the routers' token counts and
loss values over the pipeline stage's ranks, moves each expert bias one step towards
balance (--moe-router-enable-expert-bias: bias += rate x sign(mean count - count)), and
returns the step's metrics: each loss (unweighted, averaged over micro-batches and MoE
layers, Megatron's log names) and the load imbalance (max / mean tokens per expert).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.config import ModelConfig
from tessera.models.gpt import GPTModel
from tessera.models.mtp import depth_loss_mask
from tessera.models.router import LOSS_NAMES, loss_coefficients
from tessera.parallel.mesh import Mesh

IMBALANCE = "expert_load_imbalance"


def masked_loss_sum(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's LM loss: the sum of its per-token losses where the mask is 1."""
    return (losses * loss_mask).sum()


class LossTerms:
    """The LM and MTP terms of one step (or evaluation): each micro-batch's share of the
    objective, and the sums behind the logged losses."""

    def __init__(self, config: ModelConfig, mesh: Mesh, device: torch.device):
        self.depths = config.mtp_num_layers or 0
        self.mtp_weight = config.mtp_loss_scaling_factor / self.depths if self.depths else 0.0
        self.mesh = mesh
        # This rank's [LM loss sum, each depth's loss sum, each depth's number of targets].
        self.sums = torch.zeros(1 + 2 * self.depths, device=device)

    def begin(self) -> None:
        self.sums.zero_()

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        """What the step's (or an evaluation batch's) shares are divided by: the global batch's
        unmasked tokens, summed over the data x context-parallel ranks."""
        tokens = sum(batch["loss_mask"].sum() for batch in micro_batches).float()
        return _sum(tokens, self.mesh.group("dp_cp")).clamp(min=1)

    def micro_batch(self, losses: torch.Tensor, batch: dict) -> torch.Tensor:
        """A micro-batch's part of the objective, before the 1 / LM tokens scale: the masked sum
        of the LM's per-token losses [b, s], or of losses [1 + D, b, s] with the MTP depths'
        (GPTModel.head_with_mtp) weighted in."""
        loss_mask, documents = batch["loss_mask"], batch.get("documents")
        if losses.ndim == 2:
            lm = masked_loss_sum(losses, loss_mask)
            self.sums[0] += lm.detach()
            return lm
        masks = torch.stack([loss_mask] + [depth_loss_mask(loss_mask, k, documents)
                                           for k in range(1, self.depths + 1)]).to(losses.dtype)
        sums = (losses * masks).sum(dim=(1, 2))
        self.sums += torch.cat([sums.detach(), masks[1:].sum(dim=(1, 2))])
        return sums[0] + self.mtp_weight * sums[1:].sum()

    def finish(self, lm_tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed over pipeline stages (the last holds them) and data-parallel ranks: the LM
        loss (mean over `lm_tokens`, the global batch's) and each depth's mean loss, by log name."""
        sums = _sum(_sum(self.sums.clone(), self.mesh.group("pp")), self.mesh.group("dp_cp"))
        depths = self.depths
        mtp = {f"mtp_{k} loss": sums[k] / sums[depths + k].clamp(min=1) for k in range(1, depths + 1)}
        return sums[0] / lm_tokens, mtp


class MoEBalance:
    """The MoE layers' share of the objective and of the log, for one model (stage)."""

    def __init__(self, model: GPTModel, mesh: Mesh, *, num_micro_batches: int, bias_update_rate: float,
                 per_layer: bool = False):
        self.layers = model.moe_layers()
        self.mesh, self.bias_update_rate, self.per_layer = mesh, bias_update_rate, per_layer
        self.micro_batch_weight = 1.0 / (num_micro_batches * mesh.dp_size)
        self.pattern = model.config.moe_layers(with_mtp=True)   # of the whole model, also under PP
        self.total_moe_layers = sum(self.pattern)
        self._row_index: torch.Tensor | None = None
        # From the config: a pipeline stage may hold no MoE layer, yet joins the same collectives.
        self.loss_names = [LOSS_NAMES[name] for name in loss_coefficients(model.config)] \
            if model.config.num_experts else []

    @property
    def active(self) -> bool:
        return self.total_moe_layers > 0

    def _rows(self, device: torch.device) -> torch.Tensor:
        """This stage's MoE layers' global indices, kept on the device: indexing with a host
        list would copy it up and make the host wait for the GPU every step."""
        if self._row_index is None:   # one device for the run
            self._row_index = torch.tensor(list(self.layers), device=device)
        return self._row_index

    def set_loss_scale(self, loss_scale: float) -> None:
        for layer in self.layers.values():
            layer.aux_loss_scale.fill_(loss_scale * self.micro_batch_weight)

    def drop_statistics(self) -> None:
        """Forget the routing statistics counted since the last step (a pass that is not a step)."""
        for layer in self.layers.values():
            layer.router.reset_statistics()

    @torch.no_grad()
    def finish_step(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Reduce the step's routing statistics, update expert biases, reset; the metrics."""
        names = self.loss_names + [IMBALANCE]
        per_layer = torch.zeros(len(self.pattern), len(names), device=device)   # by global layer index
        if self.layers:
            routers = [layer.router for layer in self.layers.values()]
            # One collective for every layer of the stage: [layers, experts + losses].
            stats = _sum(torch.stack([torch.cat([r.tokens_per_expert, r.loss_totals]) for r in routers]),
                         self.mesh.group("tp_dp_cp"))
            counts, losses = stats[:, :routers[0].num_experts], stats[:, routers[0].num_experts:]
            for router, layer_counts in zip(routers, counts):
                if router.expert_bias is not None:
                    router.expert_bias += self.bias_update_rate * torch.sign(layer_counts.mean() - layer_counts)
                router.reset_statistics()
            rows = self._rows(device)
            per_layer[rows, :-1] = losses * self.micro_batch_weight
            per_layer[rows, -1] = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)
        per_layer = _sum(per_layer, self.mesh.group("pp"))   # every stage's layers, on every rank
        metrics = dict(zip(names, per_layer.sum(dim=0) / self.total_moe_layers))
        if self.per_layer:
            moe = [i for i, is_moe in enumerate(self.pattern) if is_moe]
            metrics.update({f"{name} layer {i}": per_layer[i, j] for i in moe for j, name in enumerate(names)})
        return metrics


def _sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor
