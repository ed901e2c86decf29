"""Multi-token prediction: depth targets and masks and the loss weights against hand-computed
cases, the MTP depths against Hugging Face's MtpLayer and a hand-written reference (values
and gradients, fp32, rtol 1e-5), pipeline stages, parameter and FLOP counts (Megatron's
terms), the trainer's log, and bad flags. Equivalence under parallel layouts:
tests/dist/test_deepseek.py."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from tessera.cli.args import parse_run_config
from tessera.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from tessera.models.documents import Documents
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.mtp import depth_loss_mask, shift_left
from tessera.parallel.mesh import Mesh
from tessera.perf.flops import count_parameters, flops_per_token
from tessera.training.losses import LossTerms
from tessera.training.trainer import Trainer

BASE = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=40,
            make_vocab_size_divisible_by=8, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
            disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
            attention_dropout=0.0, mtp_num_layers=2)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_layer_freq="([0]*1+[1]*1)",
           moe_shared_expert_intermediate_size=8)


def test_depth_targets_and_masks_by_hand():
    labels = torch.tensor([[11, 12, 13, 14, 15, 16]])   # tokens 10..15: the LM's target at t is t + 1
    assert shift_left(labels, 1).tolist() == [[12, 13, 14, 15, 16, 0]]   # depth 1: token t + 2
    assert shift_left(labels, 2).tolist() == [[13, 14, 15, 16, 0, 0]]    # depth 2: token t + 3
    mask = torch.tensor([[1.0, 1, 0, 1, 1, 1]])
    assert depth_loss_mask(mask, 1).tolist() == [[1, 0, 1, 1, 1, 0]]   # a depth's mask is its target's
    assert depth_loss_mask(mask, 2).tolist() == [[0, 1, 1, 1, 0, 0]]
    # Packed documents of 2, 1 and 3 tokens over two samples of 3: no target from the next document.
    documents = Documents.from_cu_seqlens(torch.tensor([0, 2, 3, 6], dtype=torch.int32), 2, 3, backend="dense",
                                          device=torch.device("cpu"))
    ones = torch.ones(2, 3)
    assert depth_loss_mask(ones, 1, documents).tolist() == [[1, 0, 0], [1, 1, 0]]
    assert depth_loss_mask(ones, 2, documents).tolist() == [[0, 0, 0], [1, 0, 0]]


def test_loss_weights_by_hand():
    """objective = LM sum + factor / D x each depth's sum; the logged LM loss leaves MTP out."""
    terms = LossTerms(ModelConfig(**BASE, mtp_loss_scaling_factor=0.3), Mesh(), torch.device("cpu"))
    losses = torch.tensor([[[1.0, 2, 3, 4]], [[5.0, 6, 7, 8]], [[9.0, 10, 11, 12]]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 0]])
    terms.begin()
    objective = terms.micro_batch(losses, {"loss_mask": mask})
    assert objective.item() == pytest.approx(6 + 0.15 * (11 + 9))   # depth masks [1,1,0,0] and [1,0,0,0]
    objective.backward()
    torch.testing.assert_close(losses.grad, torch.tensor([[[1.0, 1, 1, 0]], [[0.15, 0.15, 0, 0]], [[0.15, 0, 0, 0]]]))
    assert terms.micro_batch(torch.tensor([[2.0, 0, 0, 0]]), {"loss_mask": mask}).item() == 2   # evaluation: the LM alone
    lm, mtp = terms.finish(torch.tensor(5.0))
    assert lm.item() == pytest.approx(8 / 5)
    assert {name: value.item() for name, value in mtp.items()} == {"mtp_1 loss": 5.5, "mtp_2 loss": 9.0}


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


class _TesseraBlock(nn.Module):
    """HF's MtpLayer's `mtp_block`: tessera's transformer block with the model's RoPE."""

    def __init__(self, block: nn.Module, rope):
        super().__init__()
        self.block, self.rope = block, rope

    def forward(self, hidden_states, **_):
        return self.block(hidden_states, self.rope)


def _hf_depth(config: ModelConfig, depth, rope) -> MtpLayer:
    """Hugging Face's MtpLayer holding this depth's weights (enorm, hnorm, eh_proj, post_norm = final_norm)."""
    hf_config = SimpleNamespace(hidden_size=config.hidden_size, rms_norm_eps=config.norm_epsilon)
    layer = MtpLayer(hf_config, lambda _config, _index: _TesseraBlock(depth.layer, rope), DeepseekV3RMSNorm, 0)
    with torch.no_grad():
        for hf, ours in ((layer.enorm, depth.enorm), (layer.hnorm, depth.hnorm), (layer.eh_proj, depth.eh_proj),
                         (layer.post_norm, depth.final_norm)):
            hf.weight.copy_(ours.weight)
    return layer


@pytest.mark.parametrize("fields", [dict(), dict(untie_embeddings_and_output_weights=False, **MOE)],
                         ids=["dense, untied", "MoE depths, tied"])
def test_mtp_depths_match_hugging_face_and_a_hand_written_reference(fields):
    config = ModelConfig(**{**BASE, **fields})
    torch.manual_seed(0)
    model = GPTModel(config)
    initialize_parameters(model, seed=5)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    losses = model(ids, labels=labels, mtp=True)
    assert losses.shape == (3, 2, 8)
    torch.testing.assert_close(losses[0], model(ids, labels=labels), rtol=0, atol=0)   # row 0: the LM's

    # Reference: h_0 = final_norm(decoder output); each depth by hand (checked against HF's MtpLayer
    # with the same weights); the shared head and the shifted targets by hand.
    eps, rope = config.norm_epsilon, model.rotary(8, None)
    head = model.embedding.weight if model.output_weight is None else model.output_weight
    hidden = _rms(model.run_layers(model.embed(ids)), model.final_norm.weight, eps)
    expected = [_cross_entropy(hidden @ head.T, labels)]
    for k, depth in enumerate(model.mtp.layers, start=1):
        shifted = torch.cat([ids[:, k:], torch.zeros(2, k, dtype=ids.dtype)], dim=1)
        embedded = F.embedding(shifted, model.embedding.weight)
        by_hand = _rms(depth.layer(torch.cat([_rms(embedded, depth.enorm.weight, eps),
                                               _rms(hidden, depth.hnorm.weight, eps)], -1) @ depth.eh_proj.weight.T,
                                   rope), depth.final_norm.weight, eps)
        hf = _hf_depth(config, depth, rope)(embedded, hidden, None, None, None, None)
        torch.testing.assert_close(by_hand, hf, rtol=1e-5, atol=1e-6)
        hidden = by_hand   # the model's own weights, for the gradients below
        targets = torch.cat([labels[:, k:], torch.zeros(2, k, dtype=labels.dtype)], dim=1)   # token t + k + 1
        expected.append(_cross_entropy(hidden @ head.T, targets))
    expected = torch.stack(expected)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)

    # Gradients of the weighted sum, shared embedding and head included, equal autograd's of the reference.
    weights = torch.tensor([1.0, 0.05, 0.05]).view(3, 1, 1)
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad((losses * weights).sum(), params, allow_unused=True)
    reference = torch.autograd.grad((expected * weights).sum(), params, allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), ours, reference):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_pipeline_stages_place_mtp_on_the_last():
    config = ModelConfig(**BASE)
    first = GPTModel(config, layer_indices=[0], post_process=False)
    last = GPTModel(config, layer_indices=[1], pre_process=False)
    whole = dict(GPTModel(config).named_parameters())
    assert first.mtp is None and last.mtp is not None
    assert last.embedding is not None   # untied: the shifted tokens' embedding, kept equal to the first stage's
    names = {*dict(first.named_parameters()), *dict(last.named_parameters())}
    assert names == set(whole)   # the same names whatever the layout (initialisation, checkpoints)


@pytest.mark.parametrize("fields", [dict(), MOE], ids=["dense", "MoE"])
def test_parameter_and_flop_counts(fields):
    config = ModelConfig(**{**BASE, **fields})
    with torch.device("meta"):
        model = GPTModel(config)
    counted = count_parameters(config)
    assert counted.total == sum(p.numel() for p in model.parameters())
    assert counted.mtp == sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp."))
    # Megatron: each depth counts as one more layer of the last layer's kind, plus 6 (3h + 2h^2)
    # for its norms and projection and 6 h V for one more pass through the output layer.
    h, vocab, depths = config.hidden_size, config.padded_vocab_size(), config.mtp_num_layers
    deeper = ModelConfig(**{**BASE, **fields, "num_layers": 4, "mtp_num_layers": None,
                            "moe_layer_freq": "([0]*1+[1]*3)" if fields else "1"})
    without = ModelConfig(**{**BASE, **fields, "mtp_num_layers": None})
    assert flops_per_token(config) == pytest.approx(
        flops_per_token(deeper) + depths * 6 * (3 * h + 2 * h * h + h * vocab), rel=1e-12)
    if fields:   # the MoE depths' idle experts are not active parameters
        assert counted.inactive == 3 * count_parameters(without).inactive


def _trainer(tmp_path, *flags) -> Trainer:
    config, _ = parse_run_config(
        ["--num-layers", "2", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--vocab-size", "40", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--mock-data", "--lr", "1e-3", "--train-iters", "1", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-json", str(tmp_path / "log.jsonl"), *flags],
        "test")
    return Trainer(config)


def test_trainer_logs_mtp_apart_from_the_lm_loss(tmp_path, capsys):
    """The reported LM loss is the same with or without MTP (before any update); the MTP term
    enters the gradient with its factor; 'mtp_1 loss' is logged apart in the line and the JSON."""
    plain = _trainer(tmp_path).train()[0]
    off = _trainer(tmp_path, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0").train()[0]
    on = _trainer(tmp_path, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.5").train()[0]
    assert plain.loss == off.loss == on.loss and on.terms["mtp_1 loss"] == off.terms["mtp_1 loss"] > 0
    assert off.grad_norm == pytest.approx(plain.grad_norm, rel=1e-6) and on.grad_norm > off.grad_norm
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])
    assert record["mtp_1_loss"] == pytest.approx(on.terms["mtp_1 loss"]) and record["loss"] == pytest.approx(on.loss)
    assert f"| mtp_1 loss: {on.terms['mtp_1 loss']:.6E} |" in capsys.readouterr().out


@pytest.mark.parametrize("fields, parallel, message", [
    (dict(position_embedding_type="learned_absolute"), {},
     "--mtp-num-layers needs --position-embedding-type rope, yarn or none"),
    (dict(mtp_num_layers=0), {}, "--mtp-num-layers must be positive"),
    (dict(mtp_loss_scaling_factor=-0.1), {}, "--mtp-loss-scaling-factor must be >= 0"),
    ({}, dict(context_parallel_size=2), "--mtp-num-layers with --context-parallel-size > 1 is not supported"),
])
def test_bad_mtp_settings_name_their_flags(fields, parallel, message):
    with pytest.raises(ConfigError, match=message) as error:
        RunConfig(model=ModelConfig(**{**BASE, **fields}), parallel=ParallelConfig(**parallel), world_size=2)
    assert "\n" not in str(error.value)
