"""Muon in one process against torch.optim.Muon: the same matrices give the same bits, fused
weights step as their unfused matrices would, the other coefficient tables orthogonalise (SVD),
what AdamW keeps, an exact resume (and SGD's), and the layouts Muon refuses in one line."""

import pytest
import torch
from torch import nn

from tessera.cli.args import parse_run_config
from tessera.config import ConfigError
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.parallel.mesh import Mesh
from tessera.parallel.sharding import ShardSpec
from tessera.training.optim.muon import MatrixLayout, Muon, matrix_layouts, muon_parameters
from tessera.training.optim.newton_schulz import coefficient_schedule, orthogonalize
from tessera.training.trainer import Trainer
from tests.conftest import TINY, run_config

SHAPES = [(48, 16), (16, 40), (24, 24)]   # tall, wide, square
# torch.optim.Muon's maths in tessera's flags: its coefficients, bf16 iterations
AS_TORCH = dict(coefficient_type="simple", ns_steps=5, precision="medium")
# torch's adjust_lr_fn -> (--muon-scale-mode, --muon-extra-scale-factor)
ADJUST = {"match_rms_adamw": ("spectral", 0.2), "original": ("shape_scaling", 1.0)}


def _steps(optimizer, params, grads) -> None:
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()


def _random_grads(shapes, steps: int = 3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ADJUST)
def test_step_is_torch_muons_bit_for_bit(nesterov, adjust):
    start = [torch.randn(shape, generator=torch.Generator().manual_seed(1)) for shape in SHAPES]
    ours, theirs = ([nn.Parameter(w.clone()) for w in start] for _ in range(2))
    mode, extra = ADJUST[adjust]
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    grads = _random_grads(SHAPES)
    _steps(Muon(ours, scale_mode=mode, extra_scale=extra, **AS_TORCH, **options), ours, grads)
    _steps(torch.optim.Muon(theirs, adjust_lr_fn=adjust, **options), theirs, grads)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_fused_weights_step_as_their_unfused_matrices():
    """A fused QKV (three blocks) and a stack of MoE experts' gate/up weights (split along dim 1),
    against torch.optim.Muon on every block of every expert as a matrix of its own."""
    qkv = nn.Parameter(torch.randn(64 + 16 + 16, 32))
    experts = nn.Parameter(torch.randn(3, 2 * 24, 32))
    layouts = {qkv: MatrixLayout(ShardSpec(tuple(qkv.shape), 0, (64, 16, 16)), split=True),
               experts: MatrixLayout(ShardSpec(tuple(experts.shape), 1, (24, 24)), split=True)}
    blocks = [nn.Parameter(b.clone()) for b in qkv.detach().split([64, 16, 16])]
    blocks += [nn.Parameter(b.clone()) for e in experts.detach() for b in e.split([24, 24])]
    grads = _random_grads([qkv.shape, experts.shape])
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    _steps(Muon([qkv, experts], layouts=layouts, scale_mode="spectral", extra_scale=0.2, **AS_TORCH, **options),
           [qkv, experts], grads)
    block_grads = [[*q.split([64, 16, 16]), *(b for e in x for b in e.split([24, 24]))] for q, x in grads]
    _steps(torch.optim.Muon(blocks, adjust_lr_fn="match_rms_adamw", **options), blocks, block_grads)
    assert torch.equal(qkv, torch.cat(blocks[:3]))
    assert torch.equal(experts, torch.stack([torch.cat(blocks[3 + 2 * i:5 + 2 * i]) for i in range(3)]))


@pytest.mark.parametrize("kind, steps, largest_error", [("quintic", 5, 0.05), ("polar_express", 8, 1e-4)])
def test_coefficient_tables_orthogonalise(kind, steps, largest_error):
    """Each table maps a matrix U S V^T to about U V^T (fp32): the same singular vectors, singular
    values near 1 (the quintic table trades exactness for speed, as Keller Jordan's does)."""
    matrix = torch.randn(40, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    result = orthogonalize(matrix, coefficient_schedule(kind, steps), "highest")
    in_svd_basis = u.T @ result @ vh.T
    off_diagonal = in_svd_basis - torch.diag(in_svd_basis.diagonal())
    assert off_diagonal.abs().max() < 1e-4
    assert (in_svd_basis.diagonal() - 1).abs().max() < largest_error


HIDDEN = ("qkv.weight", "attention.proj.weight", "fc1.weight", "fc2.weight", "experts.fc1", "experts.fc2",
          "out_proj.weight")


@pytest.mark.parametrize("flags", [
    ["--model", "tiny-moe", "--untie-embeddings-and-output-weights"],
    ["--hybrid-layer-pattern", "M*-", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--mamba-state-dim", "4"],
], ids=["moe", "mamba hybrid"])
def test_adamw_keeps_embeddings_output_norms_routers_and_mambas_input(flags):
    model = GPTModel(run_config(*flags).model)
    chosen = {id(p) for p in muon_parameters(model)}
    for name, param in model.named_parameters():
        assert (id(param) in chosen) == name.endswith(HIDDEN), name


def test_model_step_with_fused_blocks_split_or_whole():
    """--muon-no-split-qkv orthogonalises the fused QKV whole: the attention weights then step
    otherwise, the MLP's gate/up (always split) alike."""
    config = run_config("--model", "tiny-llama").model
    results = {}
    for no_split in (False, True):
        model = GPTModel(config)
        initialize_parameters(model, seed=3)
        optim = run_config("--optimizer", "muon", *(["--muon-no-split-qkv"] if no_split else [])).optim
        params = muon_parameters(model)
        for param in params:
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel()))
        Muon(params, layouts=matrix_layouts(model, params, optim, Mesh()), lr=0.01, **AS_TORCH).step()
        results[no_split] = dict(model.named_parameters())
    split, whole = results[False], results[True]
    assert not torch.equal(split["layers.0.attention.qkv.weight"], whole["layers.0.attention.qkv.weight"])
    assert torch.equal(split["layers.0.mlp.fc1.weight"], whole["layers.0.mlp.fc1.weight"])


@pytest.mark.parametrize("optimizer", ["muon", "sgd"])
def test_resume_continues_the_momentum_exactly(tmp_path, optimizer):
    flags = ["--optimizer", optimizer, "--train-iters", "4", "--lr-warmup-iters", "1", "--muon-nesterov"]
    reference = Trainer(run_config(*flags))
    expected = [r.loss for r in reference.train()]
    first = Trainer(run_config(*flags, "--save", str(tmp_path), "--exit-interval", "2"))
    before = [r.loss for r in first.train()]
    resumed = Trainer(run_config(*flags, "--load", str(tmp_path)))
    assert (resumed.optimizer.muon or resumed.optimizer.inner).state   # the momentum came back
    after = [r.loss for r in resumed.train()]
    assert before + after == expected
    for (name, a), b in zip(resumed.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "muon", "--use-torch-fsdp2"], "--optimizer muon does not combine with --use-torch-fsdp2"),
    (["--optimizer", "sgd", "--use-distributed-optimizer"], "--optimizer sgd with --use-distributed-optimizer"),
    (["--muon-momentum", "1"], "--muon-momentum must be in"),
])
def test_unsupported_settings_are_refused_in_one_line(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_run_config([*TINY, *flags], "tessera train", world_size=2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_coefficient_steps_that_do_not_fit_are_refused():
    with pytest.raises(ConfigError, match="--muon-num-ns-steps a multiple of 5"):
        coefficient_schedule("quintic", 4)
