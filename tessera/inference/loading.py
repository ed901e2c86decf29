"""A model to generate with: from a tessera checkpoint or a Hugging Face directory, whole or
as this rank's tensor-parallel shard.

    model, info = load_model(hf="path/to/hf_dir", dtype=torch.bfloat16, device="cuda")
    model, info = load_model(load="checkpoints/run", tp_group=mesh.tp_group)   # under torchrun

A tessera checkpoint of any training layout holds every tensor by its full coordinates
(torch.distributed.checkpoint), so the full weights are read and each parameter is cut
to this rank's shard by its ShardSpec, as initialisation cuts them. The padded rows of the
vocabulary are fitted to this TP size (zero rows added, or padding rows dropped): a model
trained at TP=4 loads at TP=1 and the other way round. Sequence parallelism is off: it
buys nothing for generation. Pipeline and expert parallelism are not used here.

A checkpoint carries its tokenizer (tessera.training.checkpoint_files): `LoadedInfo.checkpoint_config`
is its config.yaml with the tokenizer paths pointing at those copies, absolute, so that the
tokenizer is found from any working directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.config import ModelConfig
from tessera.interop.hf import read_hf_dir, tessera_state_from_hf
from tessera.interop.hf_config import model_config_from_hf
from tessera.models.gpt import GPTModel


@dataclass
class LoadedInfo:
    """What generation needs to know besides the weights."""

    config: ModelConfig
    hf_config: dict | None            # config.json of the HF model (or of the one a checkpoint was imported from)
    tokenizer_dir: Path               # where tokenizer files would be: the HF directory, or the checkpoint's
    eos_token_ids: tuple[int, ...]    # from generation_config.json / config.json, where known
    # a tessera checkpoint's config.yaml: its tokenizer flags name the copies the checkpoint carries
    checkpoint_config: dict | None = None


def load_model(*, load: str | None = None, hf: str | None = None, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", tp_group=None) -> tuple[GPTModel, LoadedInfo]:
    """(GPTModel in eval mode, LoadedInfo) from `load` (a tessera checkpoint directory) or `hf`."""
    if (load is None) == (hf is None):
        raise ValueError("give one of load (a tessera checkpoint directory) or hf (a Hugging Face directory)")
    if hf is not None:
        hf_config, tensors = read_hf_dir(hf)
        config = model_config_from_hf(hf_config, vocab_multiple=1)
        state = tessera_state_from_hf(hf_config, tensors, config)
        info = LoadedInfo(config, hf_config, Path(hf), _hf_eos_token_ids(Path(hf), hf_config))
    else:
        from tessera.posttrain.lora_checkpoint import read_model

        saved = read_model(load, extra_files=("hf_config.json",))
        config, state = saved.config, saved.tensors
        hf_config = json.loads(saved.files["hf_config.json"]) if "hf_config.json" in saved.files else None
        eos = _hf_eos_token_ids(Path(load), hf_config) if hf_config else ()   # convert copied generation_config.json
        info = LoadedInfo(config, hf_config, Path(load), eos, saved.run_config)
    with torch.device(device):
        model = GPTModel(config, tp_group=tp_group)
    load_full_state(model, state)
    return model.to(dtype).eval(), info


@torch.no_grad()
def load_full_state(model: GPTModel, state: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into `model`, each parameter cut to this rank's shard."""
    expected = dict(model.named_parameters())
    expected.update((name, buffer) for name, buffer in model.state_dict(keep_vars=True).items()
                    if name not in expected)
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"the weights do not fit the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    for name, target in expected.items():
        spec = getattr(target, "shard_spec", None)
        full = state[name]
        if spec is not None:
            full = spec.shard(_fit_vocabulary(full, spec.full_shape, model.config.vocab_size, name))
        if full.shape != target.shape:
            raise ValueError(f"{name}: the weights hold {tuple(full.shape)}, the model {tuple(target.shape)}")
        target.copy_(full)


def _fit_vocabulary(full: torch.Tensor, shape: tuple[int, ...], vocab_size: int, name: str) -> torch.Tensor:
    """`full` with its padding rows (beyond the real vocabulary) added or dropped to match `shape`."""
    if tuple(full.shape) == tuple(shape):
        return full
    if full.shape[1:] != shape[1:] or min(full.shape[0], shape[0]) < vocab_size:
        raise ValueError(f"{name}: the weights hold {tuple(full.shape)}, the model needs {tuple(shape)}")
    if full.shape[0] > shape[0]:
        return full[:shape[0]]
    return torch.cat([full, full.new_zeros(shape[0] - full.shape[0], *shape[1:])])


def _hf_eos_token_ids(directory: Path, hf_config: dict) -> tuple[int, ...]:
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            return _token_ids(eos)
    return _token_ids(hf_config.get("eos_token_id"))


def _token_ids(value) -> tuple[int, ...]:
    """An HF eos_token_id field (int, list or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
