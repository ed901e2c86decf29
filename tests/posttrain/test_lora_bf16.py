"""LoRA under --bf16: the frozen base's GEMM weights stored in bf16, trained, checkpointed, exported.

Autocast casts an fp32 weight to bf16 by rounding to nearest even, as storing it in bf16 does, and
passes a bf16 weight through unchanged: the bf16 GEMMs get the same operands either way, so a run on
the stored base gives the losses, gradient norms and adapters of a run on the fp32 base bit for bit,
in one process and under each parallel layout (its frozen weights differ by their rounding alone).
"""

from __future__ import annotations

from unittest import mock

import pytest
import safetensors.torch
import torch

from tessera.cli import run
from tessera.cli.args import parse_run_config
from tessera.config import ModelConfig
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.posttrain import lora
from tessera.posttrain.lora import adapter_state, adapters, apply_lora, merge_lora, store_base_in_bf16
from tessera.training.trainer import Trainer
from tests.dist import equivalence
from tests.dist.launcher import run_distributed
from tests.hf_models import save_tiny_llama
from tests.posttrain.test_lora import LORA, randomize_adapters

RUN = ["--mock-data", "--lr", "1e-2", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32",
       "--log-interval", "1000", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--lora-rank", "4", "--lora-alpha", "8"]


def trainer(*flags: str, bf16: bool = True) -> Trainer:
    return Trainer(parse_run_config([*RUN, *flags, *(["--bf16"] if bf16 else [])], world_size=1)[0])


def is_gemm_weight(name: str) -> bool:
    """Whether a tiny Llama's or MoE's parameter is a weight of a linear layer, the experts or the output layer."""
    return name == "output_weight" or name.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight",
                                                     "experts.fc1", "experts.fc2"))


def dtypes(model) -> dict[str, torch.dtype]:
    return {name: param.dtype for name, param in model.named_parameters()}


def test_the_frozen_gemm_weights_are_bf16_and_the_rest_fp32():
    moe = trainer("--model", "tiny-moe", "--train-iters", "1").model   # experts, router, an untied output layer
    stored = {name for name, dtype in dtypes(moe).items() if dtype == torch.bfloat16}
    gemms = {name for name, _ in moe.named_parameters() if is_gemm_weight(name)}
    assert stored == gemms and "layers.1.mlp.experts.fc1" in stored
    assert all(getattr(p, "stored_bf16", False) == (name in stored) for name, p in moe.named_parameters())
    assert {name for name, p in moe.named_parameters() if p.requires_grad} == set(adapter_state(moe))
    # A tied output layer is the embedding: fp32, as norms and biases; without --bf16 nothing changes.
    tied = GPTModel(ModelConfig(**PRESETS["tiny-gpt"]))
    apply_lora(tied, LORA, seed=1)
    assert all(name.endswith(".weight") and "norm" not in name and "embedding" not in name
               for name in store_base_in_bf16(tied))
    assert {dtype for name, dtype in dtypes(tied).items() if "embedding" in name or "bias" in name
            or "norm" in name or "lora_" in name} == {torch.float32}
    assert set(dtypes(trainer("--model", "tiny-moe", "--train-iters", "1", bf16=False).model).values()) \
        == {torch.float32}


def test_merging_into_a_bf16_base_adds_in_fp32_and_stores_bf16():
    model = GPTModel(ModelConfig(**PRESETS["tiny-llama"]))
    initialize_parameters(model, seed=1)
    apply_lora(model, LORA, seed=1)
    randomize_adapters(model, seed=3)
    store_base_in_bf16(model)
    qkv = model.layers[0].attention.qkv
    expected = (qkv.weight.float() + adapters(model)["layers.0.attention.qkv"].update()).bfloat16()
    merge_lora(model)
    assert qkv.weight.dtype == torch.bfloat16 and torch.equal(qkv.weight, expected)


def bf16_base_against_fp32_base(layouts: dict[str, list[str]]) -> dict[str, tuple[dict, dict]]:
    """Each layout's results with the bf16 base and with the fp32 base autocast casts."""
    results = {}
    for name, flags in layouts.items():
        with mock.patch.object(lora, "store_base_in_bf16", lambda model: []):
            fp32_base = equivalence.train(flags)
        results[name] = (equivalence.train(flags), fp32_base)
    return results


def assert_identical(bf16_base: dict, fp32_base: dict, layout: str) -> None:
    for key in ("loss", "grad_norm", "moe"):
        assert bf16_base[key] == fp32_base[key], f"{layout}: {key} differs"
    assert bf16_base["params"].keys() == fp32_base["params"].keys()
    for name, value in bf16_base["params"].items():
        expected = fp32_base["params"][name]
        if is_gemm_weight(name):   # the frozen weight as stored: the fp32 one rounded
            expected = expected.bfloat16().float()
        assert torch.equal(value, expected), f"{layout}: {name} differs"


BF16_LORA = ["--train-iters", "2", "--lora-rank", "4", "--lora-alpha", "8", "--bf16"]
LAYOUTS = {
    "PP=2": ["--pipeline-model-parallel-size", "2"],   # fp32 hidden states between stages beside bf16 weights
    "TP=2 + SP distributed optimizer": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--use-distributed-optimizer"],
    "DP=2 FSDP2": ["--use-torch-fsdp2"],   # its bf16 gathers of a bf16 base
}


def test_a_bf16_base_trains_as_autocast_casts_an_fp32_one():
    """One process on MoE experts and an untied output layer; the layouts of tests/dist on a dense model."""
    single = bf16_base_against_fp32_base({"one process": ["--model", "tiny-moe", *BF16_LORA]})
    layouts = run_distributed(bf16_base_against_fp32_base, 2,
                              {name: ["--model", "tiny-llama", *BF16_LORA, *flags] for name, flags in LAYOUTS.items()})
    for name, (bf16_base, fp32_base) in {**single, **layouts[0]}.items():
        assert_identical(bf16_base, fp32_base, name)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """An HF Llama base (fp32) fine-tuned with LoRA under --bf16 for 4 steps, and again with an exit
    after 2 and a resume: (root, losses uninterrupted, losses with the resume, the resumed trainer)."""
    root = tmp_path_factory.mktemp("lora-bf16")
    save_tiny_llama(root / "hf")
    flags = ("--pretrained-checkpoint", str(root / "hf"), "--train-iters", "4", "--save", str(root / "out"),
             "--load", str(root / "out"))
    uninterrupted = [r.loss for r in trainer(*flags[:-4]).train()]
    first = [r.loss for r in trainer(*flags, "--exit-interval", "2").train()]
    resumed = trainer(*flags)
    start = resumed.iteration
    return root, uninterrupted, first + [r.loss for r in resumed.train()], start, resumed


def test_an_adapter_checkpoint_on_a_bf16_base_resumes_exactly(hf_run):
    _, uninterrupted, interrupted, start, resumed = hf_run
    assert start == 2 and dtypes(resumed.model)["layers.0.mlp.fc1.weight"] == torch.bfloat16
    assert interrupted == uninterrupted


def test_the_merged_export_adds_the_adapters_to_the_fp32_base(hf_run):
    """The export merges the saved fp32 adapters into the fp32 base the run loaded (not its bf16 copy)."""
    root, *_, resumed = hf_run
    assert run(["convert", "tessera-to-hf", "--input", str(root / "out"), "--output", str(root / "merged")]) == 0
    merged = safetensors.torch.load_file(root / "merged" / "model.safetensors")
    base = safetensors.torch.load_file(root / "hf" / "model.safetensors")
    trained = adapter_state(resumed.model)
    a, b = trained["layers.0.mlp.fc2.adapter.lora_A"], trained["layers.0.mlp.fc2.adapter.lora_B"]
    name = "model.layers.0.mlp.down_proj.weight"
    expected = base[name].double() + 2.0 * b.double() @ a.double()
    assert merged[name].dtype == torch.float32 and torch.equal(merged[name], expected.float())
