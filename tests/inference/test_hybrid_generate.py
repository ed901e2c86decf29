"""Generation with Mamba-2 and Gated DeltaNet layers: the engine keeps each request's conv state
and SSM or delta-rule state in slots beside the KV blocks (tessera.inference.recurrent_state).

Oracles: transformers' greedy `generate()` on tiny random `Mamba2ForCausalLM`,
`NemotronHForCausalLM` and `Qwen3NextForCausalLM` models (their caches and recurrent steps,
nothing of tessera's), and tessera's own forward over the whole sequence at every step for a
hybrid of Mamba-2, attention and MLP layers, through chunked prefill, queues and preemption. The
scan pieces are held to one scan over the whole sequence first (the delta rule's pieces in
tests/models/test_gated_deltanet.py), and each mixer's prefills and steps to its forward.
"""

import functools
import json
import shutil

import pytest
import torch
import transformers

from tessera.cli import run
from tessera.inference import cuda_graphs
from tessera.inference.engine import Engine
from tessera.inference.loading import load_model
from tessera.inference.runner import decode_logits
from tessera.inference.sampling import SamplingParams
from tessera.inference.text import HF_TOKENIZER_FILES
from tessera.kernels.ssd import ssd_scan
from tests.inference.test_decode_graphs_bookkeeping import stand_in_cuda  # noqa: F401 -- fixture
from tests.inference.test_engine import SAMPLED, check_against_full_recompute, prompts, tiny_model
from tests.inference.tiny_text_model import hf_dir, tokenizer  # noqa: F401 -- fixtures
from tests.interop.test_hf_nemotron_h import _hf_model as nemotron_h_model
from tests.interop.test_hf_qwen3_next import _hf_model as qwen3_next_model


def test_a_scan_in_pieces_from_the_state_between_them_equals_one_scan():
    """Chunks of 4 (the pieces cut inside chunks), fp64: 7 + 1 + 9 tokens from the states left
    between them equal the 17 tokens in one scan, outputs and final state."""
    generator = torch.Generator().manual_seed(0)
    draw = functools.partial(torch.randn, generator=generator, dtype=torch.float64)
    x, B, C = draw(2, 17, 4, 3), draw(2, 17, 2, 5), draw(2, 17, 2, 5)
    dt, A, D = draw(2, 17, 4).sigmoid(), -draw(4).exp(), draw(4)
    whole, final = ssd_scan(x, dt, A, B, C, D, chunk_size=4, return_final_states=True)
    state, pieces = torch.zeros(2, 4, 3, 5, dtype=torch.float64), []
    for start, end in ((0, 7), (7, 8), (8, 17)):
        y, state = ssd_scan(x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], D, chunk_size=4,
                            initial_states=state, return_final_states=True)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, final, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-qwen3-next"])   # layer 0: Mamba-2, Gated DeltaNet
def test_a_mixers_prefill_and_steps_equal_its_forward(preset):
    """Two requests: prefill of 7 tokens, then of 2 from the state left, then 11 recurrent steps."""
    mixer = tiny_model(preset).layers[0].mixer
    hidden = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(1))
    state = {name: torch.zeros(2, *shape) for name, shape in mixer.state_shapes().items()}
    outputs = []
    with torch.no_grad():
        expected = mixer(hidden)
        for start, end in ((0, 7), (7, 9)):
            out, state = mixer.prefill(hidden[:, start:end], state)
            outputs.append(out)
        for position in range(9, 20):
            out, state = mixer.step(hidden[:, position:position + 1], state)
            outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [
    dict(block_size=4),                                          # prompts whole, then decode rows together
    dict(block_size=4, max_batched_tokens=8),                    # prompts in chunks beside decode rows
    dict(block_size=16, max_batched_tokens=16, max_requests=2),  # a queue: slots handed on as requests leave
    dict(block_size=4, num_blocks=12, max_batched_tokens=12),    # preempted and recomputed
], ids=["paged", "chunked", "queued", "preempted"])
def test_hybrid_logits_equal_the_full_forward_at_every_step(options):
    """tiny-hybrid (M*-M-: Mamba-2, attention, MLP layers): the logits every sampled token comes from,
    against the model's forward over the whole sequence; prompts of 1 to 30 tokens."""
    model = tiny_model("tiny-hybrid")
    engine = Engine(model, prefix_caching=False, decode_steps=1, **options)
    check_against_full_recompute(model, engine, prompts(), SAMPLED)
    if "num_blocks" in options:
        assert engine.scheduler.preemptions > 0


def test_graphed_decode_reads_and_writes_each_requests_slot(stand_in_cuda):  # noqa: F811
    """The decode step as DecodeGraphs captures and replays it (the CUDA API stood in for on the
    CPU, as in test_decode_graphs_bookkeeping): state slots in a static buffer, padded rows on
    slot 0, greedy runs back to back, warm-up captures; the tokens of the engine without graphs."""
    model = tiny_model("tiny-hybrid")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompt_list = prompts((6, 3, 9))
    expected = [c.token_ids for c in Engine(model, decode_steps=1).generate(prompt_list, [params] * 3)]
    engine = Engine(model, block_size=4, decode_steps=4, max_seq_length=64)
    engine.runner.graphs = graphs = cuda_graphs.DecodeGraphs(
        functools.partial(decode_logits, model, engine.cache, states=engine.states), max_rows=64, max_blocks=16,
        device=torch.device("cpu"), vocab_size=engine.vocab_size, max_steps=4, compile=False, state_slots=True)
    engine.warm_up()
    assert [c.token_ids for c in engine.generate(prompt_list, [params] * 3)] == expected
    assert [c.token_ids for c in engine.generate(prompt_list[1:2], [params])] == expected[1:2]
    assert any(rows == 4 for rows, _, _ in graphs.graphs)   # three rows padded to four


VOCAB = 320   # the tiny tokenizer's


@pytest.fixture(scope="module")
def mamba2_dir(hf_dir, tmp_path_factory):  # noqa: F811
    """A tiny random Mamba2ForCausalLM beside the tiny text tokenizer; weights drawn wide, so that
    greedy choices are not near-ties, with norms, D and biases away from their defaults."""
    path = tmp_path_factory.mktemp("mamba2")
    for name in HF_TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, path / name)
    config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=4,
                                       n_groups=2, num_hidden_layers=2, chunk_size=8, initializer_range=0.2,
                                       eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".D", "bias")):
                param.normal_(0.5, 0.1)
    model.save_pretrained(path)
    return path


def _transformers_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _assert_engine_equals_transformers(reference, hf_path, prompt_lengths, vocab_size: int, new_tokens: int):
    """The prompts together, in chunks of at most 16 tokens a step (long ones continue from their
    state), then greedy runs of decode steps; each against transformers' generate() of that prompt alone."""
    generator = torch.Generator().manual_seed(1)
    prompt_list = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in prompt_lengths]
    model, info = load_model(hf=str(hf_path), dtype=torch.float32)
    engine = Engine(model, block_size=8, max_batched_tokens=16, eos_token_ids=info.eos_token_ids)
    completions = engine.generate(prompt_list, SamplingParams(max_tokens=new_tokens, temperature=0))
    for prompt, completion in zip(prompt_list, completions):
        assert completion.token_ids == _transformers_greedy(reference, prompt, new_tokens)


def test_greedy_tokens_equal_transformers_mamba2_generate(mamba2_dir):
    """Prompts of 1, 5, 17 and 40 tokens (the last continues from its state twice)."""
    reference = transformers.Mamba2ForCausalLM.from_pretrained(mamba2_dir).eval()
    _assert_engine_equals_transformers(reference, mamba2_dir, (1, 5, 17, 40), VOCAB, 24)


def test_greedy_tokens_equal_transformers_nemotron_h_generate(tmp_path):
    """Nemotron-H: Mamba-2, attention, squared-ReLU MLP and MoE layers in one model (weights drawn
    wide); prompts of 1, 6 and 30 tokens."""
    reference = nemotron_h_model(tmp_path, initializer_range=0.2)
    _assert_engine_equals_transformers(reference, tmp_path, (1, 6, 30), reference.config.vocab_size, 16)


def test_greedy_tokens_equal_transformers_qwen3_next_generate(tmp_path):
    """Qwen3-Next: Gated DeltaNet, gated attention, MoE and MLP layers (weights drawn wide); prompts
    of 1, 6, 17 and 40 tokens, the longer ones in chunks of 16 that continue from their state."""
    reference = qwen3_next_model(tmp_path, initializer_range=0.2)
    _assert_engine_equals_transformers(reference, tmp_path, (1, 6, 17, 40), reference.config.vocab_size, 16)


def test_generate_runs_a_converted_mamba2_checkpoint(mamba2_dir, tokenizer, tmp_path):  # noqa: F811
    assert run(["convert", "hf-to-tessera", "--input", str(mamba2_dir), "--output", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "out.jsonl"
    assert run(["generate", "--load", str(tmp_path / "ckpt"), "--prompt", "The quick brown", "--max-new-tokens", "8",
                "--temperature", "0", "--output-format", "jsonl", "--output", str(out)]) == 0
    reference = transformers.Mamba2ForCausalLM.from_pretrained(mamba2_dir).eval()
    expected = _transformers_greedy(reference, tokenizer.encode("The quick brown"), 8)
    assert json.loads(out.read_text())["token_ids"] == expected


def test_mixers_without_a_state_are_refused_in_one_line():
    model = tiny_model("tiny-hybrid")
    model.layers[3].mixer = torch.nn.Identity()   # a mixer that keeps no state between steps
    with pytest.raises(ValueError, match="layer 3: generation with Identity layers is not supported") as error:
        Engine(model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags, snapshots", [([], 4), (["--inference-dynamic-batching-prefix-caching-mamba-gb",
                                                          "0.0001"], None)])
def test_the_states_prefix_caching_keeps_follow_the_flag(mamba2_dir, flags, snapshots):
    """Megatron's --inference-dynamic-batching-prefix-caching-mamba-gb: as many saved states as fit in
    that many GiB (one state is every Mamba-2 layer's conv inputs and SSM state, in fp32); without it
    one per --inference-max-requests."""
    from tessera.cli.args import parse_sections
    from tessera.config.inference import InferenceConfig
    from tessera.inference.builder import build_engine

    config = parse_sections(["--hf", str(mamba2_dir), "--inference-dynamic-batching-prefix-caching",
                             "--inference-max-requests", "4", *flags], "tessera generate", "",
                            {"inference": InferenceConfig})["inference"]
    engine = build_engine(config).engine
    conv, ssm = 3 * (8 * 8 + 2 * 2 * 4), 8 * 8 * 4   # per layer: kernel-1 conv inputs of x, B, C; heads x P x N
    per_state = 2 * (conv + ssm) * 4
    expected = snapshots if snapshots is not None else int(0.0001 * 2**30 // per_state)
    assert engine.scheduler.snapshots.count == expected > 0
