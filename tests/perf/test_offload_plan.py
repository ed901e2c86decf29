"""The planner's offloading (tessera.perf.offload): what each --offload-modules name takes off the
GPU is what the offload hooks copy to the host from a real block; the optimizer's offloaded share
moves to host memory; the time it costs shows; and the search offloads only when nothing fits
without it."""

from dataclasses import replace

import pytest
import torch

from tessera.cli.args import parse_run_config
from tessera.config import ModelConfig
from tessera.models import activation_offload
from tessera.models.gpt import GPTModel
from tessera.models.presets import preset_values
from tessera.perf.cluster import CLUSTERS
from tessera.perf.kernels import load_curves
from tessera.perf.layout import Layout
from tessera.perf.memory import estimate_memory, residual_bytes
from tessera.perf.offload import offloaded_activation_bytes
from tessera.perf.search import search
from tessera.perf.simulator import predict
from tests.conftest import fused_as_on_gpus
from tests.perf.saved_tensors import B, H, HEADS, S

H200 = CLUSTERS["dgx-h200"]
CURVES = load_curves(gpu_name="H200")


def _offloaded_by_hooks(module: str) -> tuple[int, ModelConfig]:
    """Bytes the offload hooks copy to the host in one forward pass of a one-layer LLaMA block
    (bf16 autocast over fp32 weights, the fused paths taken as on GPUs)."""
    config, _ = parse_run_config(["--model", "tiny-llama", "--num-layers", "1", "--hidden-size", str(H),
                                  "--ffn-hidden-size", str(4 * H), "--num-attention-heads", str(HEADS),
                                  "--num-query-groups", str(HEADS), "--seq-length", str(S), "--hidden-dropout", "0",
                                  "--attention-dropout", "0", "--lr", "1e-3", "--train-iters", "1", "--mock-data"],
                                 "test")
    model = GPTModel(config.model)
    offload = activation_offload.install_activation_offload(model, [module], torch.device("cpu"), min_size=0)
    copied = []
    copy_down = offload._copy_down
    offload._copy_down = lambda storage: copied.append(storage.nbytes()) or copy_down(storage)
    x = torch.randn(B, S, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fused_as_on_gpus():
        model.layers[0](x, model.rotary(S, None))
    return sum(copied), config.model


@pytest.mark.parametrize("module", ["qkv_linear", "attn_proj", "mlp"])
def test_each_module_takes_what_the_hooks_copy(module):
    """Exactly, for the linears. Left out here: the norms and core attention, whose CPU kernels
    save more than the GPU ones the model counts (torch's composite RMSNorm keeps its normalised
    input beside the input, SDPA's math fallback the scores)."""
    copied, model = _offloaded_by_hooks(module)
    layout = Layout(micro_batch_size=B, framework="tessera", offload_modules=(module,))
    modelled = offloaded_activation_bytes(model, layout, S, residual_bytes(layout))
    assert copied == modelled


def _llama8b() -> ModelConfig:
    return ModelConfig(**{**preset_values("llama3-8b"), "seq_length": 4096})


def test_the_offloaded_share_of_the_optimizer_goes_to_host_memory():
    model = _llama8b()
    plain = Layout(distributed_optimizer=True, framework="tessera")
    for fraction in (1.0, 0.25):
        offloaded = replace(plain, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
        before, after = (estimate_memory(model, layout, 16, 4096) for layout in (plain, offloaded))
        assert after.host == pytest.approx(fraction * before.optimizer)
        assert after.optimizer == pytest.approx((1 - fraction) * before.optimizer)
        assert after.total < before.total and before.host == 0


def test_offloaded_activations_leave_one_layer_on_the_gpu_and_cost_host_link_time():
    model = _llama8b()
    plain = Layout(distributed_optimizer=True, framework="tessera")
    modules = ("core_attn", "attn_proj", "mlp")
    offloaded = replace(plain, offload_modules=modules)
    per_layer = offloaded_activation_bytes(model, offloaded, 4096, residual_bytes(offloaded))
    before, after = (estimate_memory(model, layout, 16, 4096) for layout in (plain, offloaded))
    assert before.activations - after.activations == pytest.approx((model.num_layers - 1) * per_layer)
    slow, fast = (predict(model, layout, H200, CURVES, 16, 4096) for layout in (offloaded, plain))
    assert slow.breakdown.get("offload", 0) > 0 and slow.step_time > fast.step_time


def test_the_search_offloads_only_when_nothing_fits_without():
    """LLaMA-3 8B at 4,096 tokens fits no H200 alone without offloading (its AdamW state is 96 GB);
    on eight it needs none."""
    model = _llama8b()
    one = search(model, 1, H200, CURVES, 16, 4096)
    assert one and all(p.layout.optimizer_cpu_offload or p.layout.offload_modules for p in one)
    assert "--optimizer-cpu-offload" in one[0].layout.flags() or "--offload-modules" in one[0].layout.flags()
    eight = search(model, 8, H200, CURVES, 64, 4096)
    assert eight and not any(p.layout.optimizer_cpu_offload or p.layout.offload_modules for p in eight)
