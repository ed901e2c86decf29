"""Continue a batch of prompts in one call: a thin wrapper over the Engine for scripts and demos.

    tokens = generate(model, prompt_ids, max_new_tokens=24, temperature=0)   # [batch, len + new]

Every row is generated to `max_new_tokens` (no end-of-sequence stop), so the rows stay one
tensor. The engine runs eagerly here (no CUDA graphs, nothing compiled): quick to start
for a few prompts. For serving, stop tokens and speed, use tessera.inference.engine.Engine.
"""

from __future__ import annotations

import torch

from tessera.inference.engine import Engine
from tessera.inference.sampling import SamplingParams
from tessera.models.gpt import GPTModel


def generate(model: GPTModel, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, vocab_size: int | None = None, seed: int = 0) -> torch.Tensor:
    """Continue `prompt` [batch, len] by `max_new_tokens` tokens; temperature 0 is greedy.

    `vocab_size` (default the model config's) excludes the output layer's padding rows.
    """
    was_training = model.training
    engine = Engine(model, max_requests=prompt.shape[0], seed=seed, prefix_caching=False, cuda_graphs=False,
                    compile=False, vocab_size=vocab_size)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0)
    completions = engine.generate(prompt.tolist(), params)
    model.train(was_training)
    new = torch.tensor([c.token_ids for c in completions], dtype=prompt.dtype, device=prompt.device)
    return torch.cat([prompt, new], dim=1)
