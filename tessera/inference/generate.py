"""Sampling text from a trained model: temperature and top-k, one token at a time.

Each new token re-runs the model over the whole sequence (no KV cache yet): simple and
exact, and fast enough for the small models of demos and tests.
"""

from __future__ import annotations

import torch

from tessera.models.gpt import GPTModel


@torch.no_grad()
def generate(model: GPTModel, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, vocab_size: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue `prompt` [batch, len] by `max_new_tokens` tokens; temperature 0 is greedy.

    `vocab_size` excludes the padding rows of the output layer from sampling.
    """
    was_training = model.training
    model.eval()
    tokens = prompt
    limit = model.config.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -limit:])[:, -1, :vocab_size].float()
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
    model.train(was_training)
    return tokens
