"""A LoRA checkpoint out of tessera: merged into its base for transformers, or as a PEFT adapter
beside its base (PEFT as the oracle), and into generation; and a PEFT adapter back in."""

import pytest
import torch
import transformers

from tessera.cli import run
from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.hf_models import save_tiny_llama

RUN = ["--mock-data", "--lr", "1e-2", "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-length", "32",
       "--log-interval", "1000", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """An HF Llama (GQA, SwiGLU) fine-tuned with LoRA for a few steps: (HF base, adapter checkpoint)."""
    root = tmp_path_factory.mktemp("lora")
    save_tiny_llama(root / "hf")
    flags = [*RUN, "--pretrained-checkpoint", str(root / "hf"), "--lora-rank", "4", "--lora-alpha", "8",
             "--train-iters", "4", "--save", str(root / "out")]
    trainer = Trainer(parse_run_config(flags, world_size=1)[0])
    trainer.train()
    tokens = torch.randint(0, 256, (2, 12))
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(tokens)[..., :256]
    return root, tokens, logits


def hf_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_the_merged_export_computes_what_the_lora_model_does(lora_run):
    root, tokens, logits = lora_run
    assert run(["convert", "tessera-to-hf", "--input", str(root / "out"), "--output", str(root / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", torch_dtype=torch.float32)
    torch.testing.assert_close(hf_logits(merged, tokens), logits, rtol=1e-5, atol=1e-5)


def test_peft_loads_the_adapters_on_the_exported_base(lora_run):
    import peft

    root, tokens, logits = lora_run
    assert run(["convert", "tessera-to-hf", "--input", str(root / "out"), "--output", str(root / "base"),
                "--peft-adapter", str(root / "adapter")]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", torch_dtype=torch.float32)
    torch.testing.assert_close(hf_logits(base, tokens), hf_logits(
        transformers.AutoModelForCausalLM.from_pretrained(root / "hf", torch_dtype=torch.float32), tokens))
    adapted = peft.PeftModel.from_pretrained(base, root / "adapter")
    torch.testing.assert_close(hf_logits(adapted, tokens), logits, rtol=1e-5, atol=1e-5)


def test_a_full_checkpoint_has_no_adapters_to_export(tmp_path, capsys):
    Trainer(parse_run_config([*RUN, "--model", "tiny-llama", "--train-iters", "1", "--save", str(tmp_path / "ck")],
                             world_size=1)[0]).train()
    with pytest.raises(SystemExit):
        run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
             "--peft-adapter", str(tmp_path / "adapter")])
    assert "--peft-adapter needs a LoRA checkpoint (trained with --lora-rank)" in capsys.readouterr().err


def test_generation_loads_a_lora_checkpoint_with_its_base_merged(lora_run):
    from tessera.inference.loading import load_model

    root, tokens, logits = lora_run
    model, _ = load_model(load=str(root / "out"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :256], logits, rtol=1e-5, atol=1e-5)


def test_a_peft_adapter_imports_as_a_lora_checkpoint(lora_run, capsys):
    from safetensors.torch import load_file

    from tessera.inference.loading import load_model

    root, tokens, logits = lora_run
    assert run(["convert", "tessera-to-hf", "--input", str(root / "out"), "--output", str(root / "peft-base"),
                "--peft-adapter", str(root / "peft")]) == 0
    assert run(["convert", "hf-to-tessera", "--input", str(root / "peft-base"), "--output", str(root / "imported"),
                "--peft-adapter", str(root / "peft")]) == 0
    model, _ = load_model(load=str(root / "imported"), dtype=torch.float32)   # merged for generation
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :256], logits, rtol=1e-5, atol=1e-5)
    # Back out as the same adapter, bit for bit.
    assert run(["convert", "tessera-to-hf", "--input", str(root / "imported"), "--output", str(root / "again"),
                "--peft-adapter", str(root / "peft-again")]) == 0
    adapter, again = (load_file(root / name / "adapter_model.safetensors") for name in ("peft", "peft-again"))
    assert adapter.keys() == again.keys()
    for key, tensor in adapter.items():
        assert torch.equal(again[key], tensor), key
    # A LoRA run starts from the imported adapters; a full fine-tune is told to merge them first.
    start = [*RUN, "--pretrained-checkpoint", str(root / "imported"), "--train-iters", "1"]
    trainer = Trainer(parse_run_config(start + ["--lora-rank", "4", "--lora-alpha", "8"], world_size=1)[0])
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(tokens)[..., :256], logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit):
        run(["train", *start])
    assert "holds LoRA adapters: train them with the checkpoint's --lora-rank" in capsys.readouterr().err
