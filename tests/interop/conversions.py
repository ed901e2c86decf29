"""The two checks every Hugging Face family's tests make: tessera's logits of a saved transformers
model against transformers' own, and the round trip through `tessera convert` (every tensor back
bit for bit, and transformers loading the export with nothing missing, left over or mis-shaped).
The asserts particular to a family stay in its test module."""

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from tessera.cli import run
from tessera.interop.hf import load_hf, read_hf_dir
from tessera.models.gpt import GPTModel


def assert_logits_match(reference: transformers.PreTrainedModel, hf_dir: Path, ids: torch.Tensor,
                        atol: float = 1e-4) -> GPTModel:
    """tessera's model of `hf_dir` (saved from `reference`) gives reference's logits on `ids` to
    within `atol`; returns that model."""
    model = load_hf(hf_dir)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, rtol=0, atol=atol)
    return model


@dataclass
class Export:
    """What came back from a round trip: both config.json dicts, and transformers' model of the export."""

    original_config: dict
    config: dict
    model: transformers.PreTrainedModel
    loading_info: dict

    def changed_fields(self) -> dict:
        """The original config's fields the export changed or left out: name -> (original, exported)."""
        return {key: (value, self.config.get(key, "missing")) for key, value in self.original_config.items()
                if self.config.get(key, "missing") != value}


def round_trip(hf_dir: Path, work_dir: Path, *, expected_dir: Path | None = None, skipped_prefix: str | None = None,
               **from_pretrained) -> Export:
    """Convert `hf_dir` to a tessera checkpoint and back (work_dir/ckpt, work_dir/out); assert that the
    export holds exactly the tensors of `expected_dir` (default `hf_dir`), bit for bit and of the
    same dtype, and that transformers loads it (with `from_pretrained`'s arguments) missing nothing,
    mis-shaping nothing and finding nothing unexpected but keys under `skipped_prefix` (layers its
    model skips)."""
    out = work_dir / "out"
    assert run(["convert", "hf-to-tessera", "--input", str(hf_dir), "--output", str(work_dir / "ckpt")]) == 0
    assert run(["convert", "tessera-to-hf", "--input", str(work_dir / "ckpt"), "--output", str(out)]) == 0
    original_config, original = read_hf_dir(expected_dir or hf_dir)
    config, tensors = read_hf_dir(out)
    assert tensors.keys() == original.keys()
    for name, tensor in original.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, **from_pretrained)
    unexpected = [key for key in info["unexpected_keys"] if not (skipped_prefix and key.startswith(skipped_prefix))]
    assert not (info["missing_keys"] or info["mismatched_keys"] or unexpected), info
    return Export(original_config, config, model.eval(), info)
