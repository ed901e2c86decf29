"""Multi-latent attention against Hugging Face's DeepseekV3Attention (an implementation no
one here wrote), with its weights copied in: outputs and gradients, q-LoRA on and off,
YaRN and plain RoPE, causal and document masks; and the flags' bad combinations.

Tolerance, fp32 on CPU: the same maths in another order (HF computes RoPE angles in
float32, tessera in float64), agreeing to ~1e-6; outputs are compared to 1e-5 absolute,
gradients by ||a - b|| / ||b|| <= 1e-5. A wrong split, interleave, scale or norm is off by
order 1.
"""

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from tessera.cli.args import parse_run_config
from tessera.config import ModelConfig
from tessera.models.documents import Documents
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.mla import MultiLatentAttention, softmax_scale
from tessera.models.rope import build_rotary

BATCH, SEQ, HIDDEN, HEADS = 2, 12, 64, 4
# theta 100 and an original length of 256 (x 4 = max_position_embeddings) put the YaRN ramp across
# the middle of the 4 frequencies
YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=256, beta_fast=32,
            beta_slow=1, mscale=0.9, mscale_all_dim=0.7)
CASES = {
    "q-lora, yarn": (24, YARN),
    "no q-lora (V2-Lite), yarn": (None, YARN),
    "q-lora, plain rope": (24, dict(rope_type="default", rope_theta=10000.0)),
}
# HF module name -> tessera module name
NAMES = {"q_proj": "q_proj", "q_a_proj": "q_down", "q_a_layernorm": "q_norm", "q_b_proj": "q_up",
         "kv_a_proj_with_mqa": "kv_down", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_up", "o_proj": "proj"}


def _hf_config(q_lora_rank, rope):
    return transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=1024,
        rope_parameters=rope, rope_interleave=True, attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-6)


def _tessera_config(hf) -> ModelConfig:
    rope = hf.rope_parameters
    yarn = rope["rope_type"] == "yarn"
    return ModelConfig(
        num_layers=1, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads, seq_length=SEQ,
        max_position_embeddings=hf.max_position_embeddings, vocab_size=32, position_embedding_type="rope",
        rotary_base=rope["rope_theta"], normalization="RMSNorm", norm_epsilon=1e-6, disable_bias_linear=True,
        qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0, multi_latent_attention=True,
        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, rope_type="yarn" if yarn else "rope",
        **(dict(rotary_scaling_factor=rope["factor"],
                yarn_original_max_position_embeddings=rope["original_max_position_embeddings"],
                yarn_beta_fast=rope["beta_fast"], yarn_beta_slow=rope["beta_slow"], mscale=rope["mscale"],
                mscale_all_dim=rope["mscale_all_dim"]) if yarn else {}))


def _pair(q_lora_rank, rope):
    """(HF attention, its rotary embedding, tessera MLA, tessera's rotary tables) with equal weights."""
    torch.manual_seed(0)
    hf_config = _hf_config(q_lora_rank, rope)
    reference = DeepseekV3Attention(hf_config, layer_idx=0)
    with torch.no_grad():  # norms away from 1: a missing norm must show
        for name, param in reference.named_parameters():
            param.normal_(1.0 if "layernorm" in name else 0.0, 0.1 if "layernorm" in name else 0.2)
    config = _tessera_config(hf_config)
    mla = MultiLatentAttention(config, output_std=0.02)
    hf_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in mla.named_parameters():
            hf_name = {v: k for k, v in NAMES.items()}[name.split(".")[0]] + "." + name.split(".")[1]
            param.copy_(hf_params[hf_name])
    assert len(hf_params) == len(list(mla.parameters()))
    return reference, DeepseekV3RotaryEmbedding(hf_config), mla, build_rotary(config)


def _inputs(documents: bool):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    grad = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if not documents:
        return x, grad, torch.arange(SEQ).expand(BATCH, -1), causal.expand(BATCH, -1, -1), None
    document = (torch.arange(SEQ) >= 5).long()  # positions restart at the second document
    positions = (torch.arange(SEQ) - 5 * document).expand(BATCH, -1)
    mask = (causal & (document[:, None] == document[None, :])).expand(BATCH, -1, -1)
    cu_seqlens = torch.tensor([row * SEQ + start for row in range(BATCH) for start in (0, 5)] + [BATCH * SEQ])
    documents = Documents.from_cu_seqlens(cu_seqlens, BATCH, SEQ, backend="per_document", device=torch.device("cpu"))
    return x, grad, positions, mask, documents


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_deepseek_v3_attention(case, documents):
    reference, hf_rotary, mla, rotary = _pair(*CASES[case])
    x, grad, positions, mask, tessera_documents = _inputs(documents)
    x_hf, x_tessera = x.clone().requires_grad_(), x.clone().requires_grad_()
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[:, None]  # HF eager takes [b, 1, s, s]
    expected, _ = reference(x_hf, hf_rotary(x_hf, positions), additive)
    actual = mla(x_tessera, rotary(SEQ, None if not documents else positions), tessera_documents)
    assert (actual - expected).abs().max().item() <= 1e-5
    (expected * grad).sum().backward()
    (actual * grad).sum().backward()
    assert _error(x_tessera.grad, x_hf.grad) <= 1e-5
    hf_params = dict(reference.named_parameters())
    for name, param in mla.named_parameters():
        module, kind = name.split(".")
        expected_grad = hf_params[{v: k for k, v in NAMES.items()}[module] + "." + kind].grad
        assert _error(param.grad, expected_grad) <= 1e-5, name


def test_deepseek_v3_softmax_scale_is_the_published_value():
    config = ModelConfig(num_layers=1, hidden_size=7168, num_attention_heads=128, seq_length=4096, vocab_size=129280,
                         position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=1536,
                         kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                         rotary_scaling_factor=40, yarn_original_max_position_embeddings=4096, mscale=1.0,
                         mscale_all_dim=1.0)
    assert config.rope_type == "yarn"  # MLA's default, as Megatron's
    assert softmax_scale(config) == pytest.approx(0.135234, abs=5e-7)


def test_mla_model_trains_and_latent_norms_follow_qk_layernorm():
    flags = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
                 position_embedding_type="rope", normalization="RMSNorm", multi_latent_attention=True,
                 kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
    plain = GPTModel(ModelConfig(**flags))
    assert not any("norm" in name for name, _ in plain.layers[0].attention.named_parameters())
    model = GPTModel(ModelConfig(**flags, qk_layernorm=True, q_lora_rank=12))
    assert {"q_norm.weight", "kv_norm.weight"} <= {name for name, _ in model.layers[0].attention.named_parameters()}
    initialize_parameters(model, seed=0)
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens, labels=tokens).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


_BASE = ["--model", "tiny-gpt", "--lr", "1e-3", "--train-iters", "1", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("flags, expected", [
    (["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"],
     "--multi-latent-attention has no key/value groups: drop --group-query-attention / --num-query-groups"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim (7) must be even"),
    (["--multi-latent-attention", "--v-head-dim", "0"], "--v-head-dim must be positive"),
    (["--kv-lora-rank", "16"], "--kv-lora-rank needs --multi-latent-attention"),
    (["--latent-norm-epsilon", "1e-6"], "--latent-norm-epsilon needs --multi-latent-attention"),
    (["--multi-latent-attention", "--qk-head-dim", "128", "--kv-channels", "192"],
     "--kv-channels (192) does not add up with --multi-latent-attention: a query/key head is --qk-head-dim + "
     "--qk-pos-emb-head-dim = 128 + 64 channels"),
    (["--multi-latent-attention", "--position-embedding-type", "learned_absolute"],
     "--multi-latent-attention needs --position-embedding-type rope or yarn"),
    (["--multi-latent-attention", "--rotary-scaling-factor", "40"],
     "--rotary-scaling-factor 40.0 (YaRN) needs --yarn-original-max-position-embeddings"),
])
def test_bad_flags_are_one_line_naming_them(capsys, flags, expected):
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(_BASE + flags)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines

