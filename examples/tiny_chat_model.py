"""A tiny chat model made offline, standing in for one downloaded from the hub: a tokenizer with a
ChatML chat template and a random Llama, saved as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the turn format of Qwen's and many other chat models' templates.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_chat_tokenizer(path: Path) -> transformers.PreTrainedTokenizerFast:
    """One token per byte (a byte-level BPE without merges: a tiny model learns letters more easily
    than subwords) and ChatML's special tokens, saved at `path` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([], trainers.BpeTrainer(vocab_size=len(alphabet) + len(SPECIAL_TOKENS),
                                                    special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                                     pad_token="<|endoftext|>", chat_template=CHATML)
    tokenizer.save_pretrained(path)
    return tokenizer


def save_tiny_llama(path: Path, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 96,
                    max_position_embeddings: int = 64, **config) -> Path:
    """A random LlamaForCausalLM with GQA and SwiGLU (2 layers, 4 query heads, 2 key-value heads, untied
    embeddings), the same weights for the same sizes, saved at `path`."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                      intermediate_size=intermediate_size, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                                      **config)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def save_tiny_chat_model(path: Path) -> Path:
    """The tokenizer and a random Llama of 0.4M parameters (hidden 128) for it, in one directory."""
    tokenizer = save_chat_tokenizer(path)
    return save_tiny_llama(path, vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                           max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
