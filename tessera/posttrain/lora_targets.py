"""Which linear layers get LoRA adapters: --lora-target-modules minus --lora-exclude-modules.

A pattern is a layer's name, or a wildcard (fnmatch: `*` spans dots) over module paths, as in
Megatron-Bridge's LoRA (src/megatron/bridge/peft/module_matcher.py, ModuleMatcher.match). Names
and paths are Megatron-Core's or tessera's, whichever the user writes:

    Megatron-Core                                     tessera
    decoder.layers.0.self_attention.linear_qkv        layers.0.attention.qkv
    decoder.layers.0.self_attention.linear_proj       layers.0.attention.proj
    decoder.layers.0.mlp.linear_fc1 / linear_fc2      layers.0.mlp.fc1 / fc2
    decoder.layers.1.mlp.experts.linear_fc1           layers.1.mlp.experts.fc1   (every routed expert)
    decoder.layers.1.mlp.shared_experts.linear_fc1    layers.1.mlp.shared_expert.fc1
    ...self_attention.linear_q_proj, linear_q_up_proj, linear_kv_up_proj   MLA's attention.q_proj, q_up, kv_up
    mtp.layers.0.transformer_layer...                 mtp.layers.0.layer...

Patterns are checked against the whole model, not one pipeline stage's layers: a pattern that
names no layer of the model is a typo, and one line says so; one that names only another
stage's layers selects nothing here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.models.gpt import GPTModel
from tessera.models.moe import GroupedExperts
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear

# tessera's module names -> Megatron-Core's, part by part.
_MEGATRON_NAMES = {"attention": "self_attention", "qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1",
                   "fc2": "linear_fc2", "q_proj": "linear_q_proj", "q_up": "linear_q_up_proj",
                   "kv_up": "linear_kv_up_proj", "shared_expert": "shared_experts", "layer": "transformer_layer"}
# The tensor-parallel layers that take adapters, by their name in a block.
_LINEARS = ("qkv", "proj", "fc1", "fc2", "q_proj", "q_up", "kv_up")
_WILDCARDS = "*?["


@dataclass(frozen=True)
class Site:
    """A linear layer an adapter can go on: a TP layer, or one of a MoE layer's grouped GEMMs."""

    path: str              # tessera's module path (a grouped GEMM's: the experts' path + ".fc1")
    module: nn.Module      # the ColumnParallelLinear / RowParallelLinear, or the GroupedExperts
    weight: str | None     # "fc1" / "fc2" of a GroupedExperts; None for a TP layer

    @property
    def megatron_path(self) -> str:
        parts = [_MEGATRON_NAMES.get(part, part) for part in self.path.split(".")]
        return ".".join(["decoder", *parts] if parts[0] == "layers" else parts)


def sites(model: nn.Module) -> list[Site]:
    """Every linear layer of `model` that can take an adapter, in module order."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and path.rsplit(".", 1)[-1] in _LINEARS:
            found.append(Site(path, module, None))
        elif isinstance(module, GroupedExperts):
            found += [Site(f"{path}.{weight}", module, weight) for weight in ("fc1", "fc2")]
    return found


def matches(pattern: str, site: Site) -> bool:
    """Whether `pattern` (a layer's name, or a wildcard over paths) names `site`."""
    paths = (site.path, site.megatron_path)
    if "." not in pattern and not any(c in pattern for c in _WILDCARDS):
        return any(path.rsplit(".", 1)[-1] == pattern for path in paths)
    return any(fnmatch.fnmatchcase(path, pattern) for path in paths)


def select_sites(model: nn.Module, targets: list[str], excludes: list[str] | None) -> list[Site]:
    """The sites of `model` that some target names and no exclusion does; one line naming the flag
    when a pattern names no layer of the whole model."""
    whole = whole_model_sites(model.config) if isinstance(model, GPTModel) else sites(model)
    for flag, patterns in (("--lora-target-modules", targets), ("--lora-exclude-modules", excludes or [])):
        for pattern in patterns:
            if not any(matches(pattern, site) for site in whole):
                names = sorted({site.megatron_path.rsplit(".", 1)[-1] for site in whole})
                example = f", or module paths such as {whole[0].path}" if whole else ""
                raise ConfigError(f"{flag}: '{pattern}' names no layer of this model (its layers: "
                                  f"{', '.join(names) or 'none'}{example})")
    return [site for site in sites(model) if any(matches(p, site) for p in targets)
            and not any(matches(p, site) for p in excludes or [])]


def whole_model_sites(config: ModelConfig) -> list[Site]:
    """The sites of the whole model `config` describes (built without storage: a pipeline stage
    holds only some of its layers)."""
    with torch.device("meta"):
        return sites(GPTModel(config))
