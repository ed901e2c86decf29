"""Parameter counts and model FLOPs, by Megatron-LM's formula (MFU-style).

Model FLOPs count the work of one forward and one backward pass; recomputation is not
counted, so MFU does not reward recomputing. A multiply-add is 2 FLOPs, and backward
costs twice forward (input gradient + weight gradient), hence the factor 6 = 2 x 3 on
every GEMM with one operand a weight. Per token, with h = hidden, q = heads x head dim,
kv = query groups x head dim, f = ffn width, G = 3 gated (SwiGLU) or 2 (GeLU), V = padded
vocabulary and L = layers:

    linear  = 6 * [ L * ( h*(q + 2*kv)      QKV projection
                        + q*h                attention output projection
                        + G*h*f )            MLP (gate and up, down)
                    + h*V ]                  logits

Core attention (Q K^T and A V, each 2*s*q FLOPs per token forward) is causal: only the
lower triangle of the s x s scores is needed, so each GEMM counts half, giving per token

    attention = 6 * L * q * s      ( = 3 passes * 2 FLOP * 2 GEMMs * q * s / 2 )

For GPT-3 shapes (q = kv = h, f = 4h) this is 72*B*s*L*h^2 * (1 + s/(12h) + V/(12*L*h)) per
iteration, the sanity check in Megatron-LM. Megatron before March 2025 counted attention
without the causal halving (s/(6h) instead of s/(12h)); `causal=False` gives that count.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    embedding: int       # word and position embeddings, and an untied output layer
    non_embedding: int   # transformer blocks and the final norm

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding


def _norm_params(config: ModelConfig) -> int:
    return config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)


def count_parameters(config: ModelConfig, vocab_size: int | None = None) -> ParamCount:
    """Exact parameter count of GPTModel(config); `vocab_size` defaults to the padded vocabulary."""
    h, f = config.hidden_size, config.ffn_hidden_size
    q = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    vocab = vocab_size if vocab_size is not None else config.padded_vocab_size()
    bias = config.add_bias_linear
    gate = 2 if config.swiglu else 1
    attention = h * (q + 2 * kv) + q * h
    attention += (q + 2 * kv) * (bias or config.add_qkv_bias) + h * bias
    mlp = gate * h * f + f * h + (gate * f + h) * bias
    per_layer = attention + mlp + 2 * _norm_params(config)
    embedding = vocab * h * (1 if config.tie_embeddings else 2)
    if config.position_embedding_type == "learned_absolute":
        embedding += config.max_position_embeddings * h
    return ParamCount(embedding, config.num_layers * per_layer + _norm_params(config))


def flops_per_token(config: ModelConfig, seq_length: int | None = None, vocab_size: int | None = None,
                    causal: bool = True) -> float:
    """Model FLOPs (forward + backward) per trained token."""
    h, f, layers = config.hidden_size, config.ffn_hidden_size, config.num_layers
    s = seq_length if seq_length is not None else config.seq_length
    q = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    vocab = vocab_size if vocab_size is not None else config.padded_vocab_size()
    gated = 3 if config.swiglu else 2
    linear = layers * (h * (q + 2 * kv) + q * h + gated * h * f) + h * vocab
    attention = layers * q * s * (1 if causal else 2)
    return 6.0 * (linear + attention)


def flops_per_iteration(config: ModelConfig, global_batch_size: int, seq_length: int | None = None,
                        vocab_size: int | None = None, causal: bool = True) -> float:
    """Model FLOPs of one iteration over `global_batch_size` sequences (all GPUs together)."""
    s = seq_length if seq_length is not None else config.seq_length
    return global_batch_size * s * flops_per_token(config, s, vocab_size, causal)
