"""MoE router replay under GRPO (--moe-enable-routing-replay): the training forward sends each token to
the experts the engine chose in the rollout, layer by layer, even after the router has moved; with
the rollout's weights it computes what the router's own choice does; a GRPO step trains with it;
and the flag outside a MoE GRPO run stops in one line."""

from __future__ import annotations

import pytest
import torch

from tessera.cli.args import parse_run_config
from tessera.inference.engine import Engine
from tessera.inference.sampling import SamplingParams
from tessera.models.router import Router
from tessera.posttrain.grpo_replay import ROUTED_EXPERTS
from tessera.training.trainer import Trainer
from tests.posttrain.test_grpo_rollout import GRPO, write_prompts

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
REPLAY = MOE + ["--moe-enable-routing-replay"]


def vowels(prompt, completion: str, answer) -> float:
    """A reward a random model earns something of, so that a step has a gradient."""
    return sum(c in "aeiou0123456789" for c in completion) - 1.0


def trainer(flags: list[str]) -> Trainer:
    return Trainer(parse_run_config(GRPO + flags, "test", world_size=1)[0])


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> list[str]:
    return ["--data-path", write_prompts(tmp_path_factory.mktemp("replay") / "prompts.jsonl")]


@pytest.fixture(scope="module")
def rollout(prompts) -> tuple[Trainer, list[dict]]:
    """A MoE policy with replay on, and the micro-batches of its first rollout."""
    run = trainer(prompts + REPLAY)
    return run, [next(run.train_data) for _ in range(run.config.num_micro_batches)]


def routers(model) -> list[Router]:
    return [module for module in model.modules() if isinstance(module, Router)]


def routed(model, tokens: torch.Tensor, run_model) -> tuple[torch.Tensor, torch.Tensor]:
    """run_model's output and the experts every token went to [rows, seq, layers, k]: the router's
    Routing, as the dispatcher receives it."""
    used = []
    hooks = [router.register_forward_hook(lambda module, args, out: used.append(out[0].expert_index))
             for router in routers(model)]
    try:
        out = run_model()
    finally:
        for hook in hooks:
            hook.remove()
    rows, seq = tokens.shape
    return out, torch.stack([experts.view(rows, seq, -1) for experts in used], dim=2)


def forward(run: Trainer, batch: dict, *, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [rows, seq] and the experts used; without replay the model runs on a copy of the tokens."""
    tokens = batch["tokens"] if replay else batch["tokens"].clone()
    return routed(run.model, tokens, lambda: -run._token_losses(run.model, {**batch, "tokens": tokens}))


def recorded(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's experts [rows, seq, layers, k] and where it ran a forward [rows, seq]."""
    experts = batch[ROUTED_EXPERTS].long()
    ran = (experts >= 0).all(dim=-1).all(dim=-1)
    assert torch.equal(ran, (experts >= 0).any(dim=-1).any(dim=-1))   # a token's record is whole or absent
    # The engine fed the prompt and the answer but its last token: the inputs up to the last masked label.
    assert torch.equal(ran, batch["loss_mask"].flip(1).cumsum(1).flip(1) > 0)
    return experts, ran


@torch.no_grad()
def test_with_the_rollouts_weights_replay_changes_nothing(rollout):
    """The engine's record is the trainer's own routing of the same tokens (so it is laid out by row and
    position), and the replayed forward's log-probs are the normal forward's (fp32, 1e-6)."""
    run, batches = rollout
    for batch in batches:
        experts, ran = recorded(batch)
        replayed, _ = forward(run, batch, replay=True)
        own, own_experts = forward(run, batch, replay=False)
        assert torch.equal(own_experts[ran].sort(dim=-1).values, experts[ran].sort(dim=-1).values)
        assert (replayed - own).abs().max() <= 1e-6


@torch.no_grad()
def test_the_engine_records_prompt_chunks_and_decode_steps_by_position(rollout):
    """Prompts cut into chunks of a 5-token step budget beside other requests' decode steps: each
    request's record is the model's own routing of its whole sequence, position by position."""
    run, _ = rollout
    engine = Engine(run.model, max_requests=3, max_seq_length=24, max_batched_tokens=5, record_routing=True)
    prompts = [[1 + i for i in range(length)] for length in (7, 3, 11)]
    completions = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=1, seed=0, ignore_eos=True))
    for completion in completions:
        sequence = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        _, own = routed(run.model, sequence, lambda: run.model(sequence))
        fed = sequence.shape[1] - 1
        assert completion.routed_experts.shape == (fed + 1, *own.shape[2:])
        assert torch.equal(completion.routed_experts[:fed].long().sort(dim=-1).values, own[0, :fed].sort(dim=-1).values)
        assert (completion.routed_experts[fed] == -1).all()


def test_a_moved_router_replays_the_rollouts_experts(rollout):
    """After the router weights move, the replayed forward uses the recorded experts token for token and
    layer for layer (the router's own choice differs), and the router still gets a gradient."""
    run, batches = rollout
    weights = [router.weight.detach().clone() for router in routers(run.model)]
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for router in routers(run.model):
                router.weight.add_(torch.randn(router.weight.shape, generator=generator))
        for batch in batches:
            experts, ran = recorded(batch)
            run.model.zero_grad()
            log_probs, used = forward(run, batch, replay=True)
            assert torch.equal(used[ran], experts[ran])
            (log_probs * batch["loss_mask"]).sum().backward()
            assert all(router.weight.grad.abs().sum() > 0 for router in routers(run.model))
            with torch.no_grad():
                _, own = forward(run, batch, replay=False)
            assert not torch.equal(own[ran], experts[ran])   # without replay the test would fail
    finally:
        with torch.no_grad():
            for router, weight in zip(routers(run.model), weights):
                router.weight.copy_(weight)
        run.model.zero_grad()


def test_a_grpo_step_trains_with_replay(prompts):
    """pi_old, the frozen reference and the policy step all replay; the first step's ratio is 1 and the
    engine's log-probs are the trainer's; the routers train."""
    run = trainer(prompts + REPLAY + ["--grpo-iterations", "2", "--grpo-kl-coeff", "0.1", "--train-iters", "1",
                                      "--grpo-reward", f"{__name__}:vowels"])
    before = [router.weight.detach().clone() for router in routers(run.model)]
    (step,) = run.train()
    assert torch.isfinite(torch.as_tensor(step.loss)) and step.terms["clip_ratio"] == 0
    assert step.terms["logprob_gap"] <= 1e-6
    assert all(not torch.equal(router.weight, weight) for router, weight in zip(routers(run.model), before))


@pytest.mark.parametrize("flags, world_size, says", [
    (["--model", "tiny-llama", "--mock-data", "--lr", "1e-3", "--train-iters", "1", *REPLAY], 1,
     "--moe-enable-routing-replay needs --grpo"),
    (["--model", "tiny-llama", "--mock-data", "--lr", "1e-3", "--train-iters", "1", "--rl-kv-cache-management-mode",
      "recompute"], 1, "--rl-kv-cache-management-mode needs --grpo"),
    (GRPO + ["--moe-enable-routing-replay"], 1, "--moe-enable-routing-replay needs a MoE model (--num-experts)"),
    (GRPO + REPLAY + ["--moe-expert-capacity-factor", "1"], 1,
     "--moe-enable-routing-replay does not combine with --moe-expert-capacity-factor"),
    (GRPO + MOE + ["--expert-model-parallel-size", "2"], 2,
     "--grpo does not combine with --expert-model-parallel-size or --expert-tensor-parallel-size > 1"),
    (GRPO + MOE + ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"], 2,
     "--grpo does not combine with --moe-router-load-balancing-type global_aux_loss on data-parallel ranks"),
])
def test_the_flag_outside_a_moe_grpo_run_is_one_line(prompts, flags, world_size, says, capsys):
    with pytest.raises(SystemExit):
        parse_run_config(flags + (prompts if "--grpo" in flags else []), "test", world_size=world_size)
    error = capsys.readouterr().err
    assert says in error and error.count("\n") == 1
