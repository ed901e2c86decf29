"""Tiny Hugging Face models saved for the tests that start from one (transformers as the oracle)."""

from examples.tiny_chat_model import save_tiny_llama  # noqa: F401 -- the tests' tiny Llama is the example's
