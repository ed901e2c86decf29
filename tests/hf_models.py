"""Tiny Hugging Face models saved for the tests that start from one (transformers as the oracle)."""

from pathlib import Path

import torch
import transformers


def save_tiny_llama(path: Path) -> Path:
    """A random LlamaForCausalLM with GQA and SwiGLU (2 layers, hidden 64, 256 tokens), saved at `path`."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path
