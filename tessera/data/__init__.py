"""Data: tokenizers, Megatron .bin/.idx datasets, GPT samples, blending and loading."""
