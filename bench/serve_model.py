"""A Hugging Face directory for bench/serve_load.py: a LLaMA of config B's shape (bench/generate.py's
CONFIGS, random weights, bf16) with a byte-level BPE of its vocabulary trained on random words and
a plain chat template. Nothing is downloaded, so the server's load test runs on a machine with no
model hub.

    python bench/serve_model.py HF_DIR [--config B|tiny]
    python bench/serve_load.py --clients 64 -- --hf HF_DIR --port 8011

The weights are made on the GPU when there is one (initialising 1.2B parameters on the CPU is
slow). The bench's prompts are English words, which this tokenizer does not know: a
128-"token" prompt is ~280 of its tokens.
"""

from __future__ import annotations

import argparse
import random

import torch
from generate import CONFIGS

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE of `vocab_size` tokens (<s> and </s> first) trained on random lowercase words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(60_000)]
    lines = [" ".join(rng.choice(words) for _ in range(64)) for _ in range(4_000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--config", default="B", choices=CONFIGS)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    c = CONFIGS[args.config]
    train_tokenizer(c["vocab_size"]).save_pretrained(args.out)
    config = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                         intermediate_size=c["ffn_hidden_size"], num_hidden_layers=c["num_layers"],
                         num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_query_groups"],
                         max_position_embeddings=c["max_position_embeddings"], rope_theta=c["rotary_base"],
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    print(f"{args.out}: config {args.config}, {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
