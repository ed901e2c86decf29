"""Greedy generation equal to Hugging Face transformers' `generate()`, token for token: tiny random
models of each family built from transformers' config classes, saved with save_pretrained,
loaded through tessera.inference.loading (nothing downloaded).

The engine runs the prompts together (continuous batching over the paged cache); the oracle
runs each prompt alone (no padding). EOS ends both: transformers reads it from the saved
generation config, the engine from what load_model found (with these seeds, some prompts
stop early). Weights are drawn wider than transformers' default (std 0.2, norms and biases
random) so that greedy choices are not near-ties that rounding could flip, and the tiny
models do not fall into repeating one token at once; the seeds are fixed.
"""

import pytest
import torch
import transformers

from tessera.inference.engine import Engine
from tessera.inference.loading import load_model
from tessera.inference.sampling import SamplingParams

VOCAB = 101
NEW_TOKENS = 64
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128, initializer_range=0.2,
                eos_token_id=2)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_DECODER, num_key_value_heads=2, rope_theta=500000.0),
    "qwen2": lambda: transformers.Qwen2Config(**_DECODER, num_key_value_heads=1, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**_DECODER, num_key_value_heads=2, sliding_window=None),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            initializer_range=0.5, bos_token_id=0, eos_token_id=0),
    "mixtral": lambda: transformers.MixtralConfig(**dict(_DECODER, intermediate_size=48), num_key_value_heads=2,
                                                  num_local_experts=4, num_experts_per_tok=2),
}


def _save_hf_model(family: str, path):
    torch.manual_seed(0)
    extra = dict(experts_implementation="eager") if family == "mixtral" else {}
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), **extra).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith(("wte.weight", "wpe.weight")):
                param.normal_(0.0, 0.05)   # GPT-2 (tied): else the last token's own embedding picks the next
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(family, tmp_path):
    reference = _save_hf_model(family, tmp_path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (3, 17, 40)]
    model, info = load_model(hf=str(tmp_path), dtype=torch.float32)
    assert info.eos_token_ids == (reference.generation_config.eos_token_id,)
    engine = Engine(model, block_size=8, eos_token_ids=info.eos_token_ids)
    completions = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                          pad_token_id=info.eos_token_ids[0])[0, len(prompt):].tolist()
        assert completion.token_ids == expected
        assert completion.finish_reason == ("stop" if len(expected) < NEW_TOKENS else "length")
