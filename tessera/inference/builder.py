"""The engine that `tessera generate` and `tessera serve` run: model, tokenizer and engine from an InferenceConfig."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.config import ConfigError
from tessera.config.inference import InferenceConfig
from tessera.inference.engine import Engine
from tessera.inference.loading import load_model
from tessera.inference.lockstep import TensorParallel, init_tensor_parallel
from tessera.inference.recurrent_state import StatePool
from tessera.inference.text import TextTokenizer, load_tokenizer, read_chat_template


@dataclass
class BuiltEngine:
    engine: Engine                      # this rank's shard under tensor parallelism
    tokenizer: TextTokenizer
    model_name: str                     # the model directory's name
    parallel: TensorParallel | None     # None in one process


def weights_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def build_engine(config: InferenceConfig) -> BuiltEngine:
    """Load the model and tokenizer `config` names and build its engine; ConfigError (one line naming
    the flag or file) on a bad one. Under tensor parallelism every rank gets the same KV cache size."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not Path(config.source).is_dir():
        raise ConfigError(f"{config.source_flag} {config.source}: no such directory")
    try:
        chat_template = read_chat_template(config.chat_template)
        parallel = init_tensor_parallel(config.tensor_model_parallel_size, device, config.distributed_timeout_minutes)
        device = parallel.device if parallel else device
        model, info = load_model(load=config.load, hf=config.hf, dtype=weights_dtype(config.dtype, device),
                                 device=device, tp_group=parallel.model_group if parallel else None)
        tokenizer = load_tokenizer(
            tokenizer_type=config.tokenizer_type, tokenizer_model=config.tokenizer_model,
            vocab_file=config.vocab_file, merge_file=config.merge_file, chat_template=chat_template,
            search_dirs=[info.tokenizer_dir], checkpoint_config=info.checkpoint_config)
        eos = tuple(dict.fromkeys((*info.eos_token_ids, *tokenizer.eos_token_ids)))

        def make_engine(num_blocks: int | None = None) -> Engine:
            return Engine(model, max_requests=config.inference_max_requests, num_blocks=num_blocks,
                          max_seq_length=config.inference_max_seq_length, eos_token_ids=eos, seed=config.seed,
                          decode_steps=config.inference_decode_steps,
                          prefix_caching=config.inference_dynamic_batching_prefix_caching,
                          state_snapshots=_state_snapshots(model, config.inference_dynamic_batching_prefix_caching_mamba_gb))

        engine = parallel.agree_on_cache(make_engine) if parallel else make_engine()
    except (FileNotFoundError, ValueError) as exc:   # ConfigError is a ValueError
        raise ConfigError(str(exc)) from None
    return BuiltEngine(engine, tokenizer, Path(config.source).resolve().name, parallel)


def _state_snapshots(model, gib: float | None) -> int | None:
    """How many recurrent states --inference-dynamic-batching-prefix-caching-mamba-gb holds (None: the
    engine's default)."""
    per_state = StatePool.bytes_per_slot(StatePool.model_shapes(model))
    return int(gib * 2**30 // per_state) if gib is not None and per_state else None
