"""The engine against full recomputation: the logits it samples from at every step equal the
model's logits over the whole sequence so far (no cache), through prefill, chunked prefill,
decode, paged blocks, mixed batches, preemption and resume, and prefix caching; and its API.

Tolerance, fp32 on CPU: the cached path adds the same products in another order (attention
over gathered blocks with masks, one prompt at a time), a few ulps of the logits: rtol 1e-5
with atol 1e-5 for logits near 0.
"""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.inference.engine import Engine
from tessera.inference.generate import generate
from tessera.inference.kv_cache import BlockAllocator
from tessera.inference.sampling import SamplingParams
from tessera.inference.scheduler import Request, Scheduler
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import preset_values

PROMPT_LENGTHS = (5, 30, 1, 17, 9)
MAX_TOKENS = (14, 8, 18, 6, 11)   # requests finish at different steps


def tiny_model(preset: str = "tiny-llama") -> GPTModel:
    values = {key: value for key, value in preset_values(preset).items() if key != "mtp_num_layers"}
    values.update(hidden_dropout=0.0, attention_dropout=0.0, seq_length=64, max_position_embeddings=64,
                  init_method_std=0.2)   # wide weights: logits far apart, so greedy choices are clear
    model = GPTModel(ModelConfig(**values))
    initialize_parameters(model, seed=1)
    return model.eval()


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def record_greedy_runs(engine: Engine) -> list[tuple[str, int]]:
    """Wraps an engine's runner: ("start" or "continue", steps) of every greedy run it queues."""
    runs, runner = [], engine.runner
    start, resume = runner.start_greedy, runner.continue_greedy
    runner.start_greedy = lambda rows, n: runs.append(("start", n)) or start(rows, n)
    runner.continue_greedy = lambda run, rows, n: runs.append(("continue", n)) or resume(run, rows, n)
    return runs


class Recorder:
    """Wraps an engine's sampler: keeps (request id, tokens so far, logits) of every row it samples."""

    def __init__(self, engine: Engine):
        self.sampler, self.rows = engine.sampler, []
        engine.sampler = self

    def __call__(self, logits, requests):
        for row, request in zip(logits, requests):
            self.rows.append((request.request_id, request.num_tokens, row.clone()))
        return self.sampler(logits, requests)


def check_against_full_recompute(model, engine, prompt_list, params_list):
    recorder = Recorder(engine)
    completions = engine.generate(prompt_list, params_list)
    sequences = {f"generate-0-{i}": p + c.token_ids for i, (p, c) in enumerate(zip(prompt_list, completions))}
    with torch.no_grad():
        full = {rid: model(torch.tensor([seq[:-1]]))[0, :, :engine.vocab_size] for rid, seq in sequences.items()}
    steps = {rid: 0 for rid in sequences}
    for rid, length, logits in recorder.rows:
        want = full[rid][length - 1]
        # fp32 summed in another order (cached blocks, chunks): within 1e-5 of the row's scale
        # (the largest differences seen, 1.2e-5 on logits up to 4-8, are ~3e-6 of it).
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        steps[rid] += 1
    for (rid, seq), prompt, completion in zip(sequences.items(), prompt_list, completions):
        assert steps[rid] == len(completion.token_ids) == len(seq) - len(prompt)   # every token was checked
    return completions


GREEDY = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
SAMPLED = [SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
           for i, n in enumerate(MAX_TOKENS)]


@pytest.mark.parametrize("options", [
    dict(block_size=4),                                          # prefill in one step, then decode
    dict(block_size=4, max_batched_tokens=8),                    # chunked prefill beside decode rows
    dict(block_size=16, max_batched_tokens=16, max_requests=2),  # a queue: at most two at a time
], ids=["paged", "chunked", "queued"])
def test_cached_logits_equal_full_recompute(options):
    model = tiny_model()
    engine = Engine(model, prefix_caching=False, decode_steps=1, **options)   # every token through the sampler
    check_against_full_recompute(model, engine, prompts(), GREEDY)


def test_a_prompt_is_cut_to_fill_a_step_only_when_no_other_prompt_is_in_it():
    """Budget 16: the 12-token prompt after a 6-token one waits for the next step rather than
    leave a continued row (steps with one run without CUDA graphs); a 40-token prompt, first
    in its step, is cut beside the others' decode rows; the 3-token prompt after it waits
    while the 40's last chunk is in the step."""
    scheduler = Scheduler(BlockAllocator(64, 4), max_requests=8, max_batched_tokens=16)
    requests = [Request(str(n), list(range(n)), SamplingParams(max_tokens=4), 0) for n in (6, 12, 40, 3)]
    for request in requests:
        scheduler.add(request)
    steps = []
    for _ in range(6):
        rows = scheduler.schedule()
        steps.append([(row.request.request_id, row.start, row.count) for row in rows])
        for row in rows:   # each row's tokens computed; a finished prompt gets its next token
            row.request.computed = row.start + row.count
            if row.samples:
                row.request.output_token_ids.append(0)
    assert steps == [[("6", 0, 6)],
                     [("6", 6, 1), ("12", 0, 12)],
                     [("6", 7, 1), ("12", 12, 1), ("40", 0, 14)],
                     [("6", 8, 1), ("12", 13, 1), ("40", 14, 14)],
                     [("6", 9, 1), ("12", 14, 1), ("40", 28, 12)],
                     [("6", 10, 1), ("12", 15, 1), ("40", 40, 1), ("3", 0, 3)]]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt", "tiny-moe", "tiny-deepseek"])
def test_preemption_and_resume_recompute_the_same_logits(preset):
    """11 usable blocks of 4 tokens for 5 requests of up to 48: requests are preempted and recomputed.
    GPT: learned positions, LayerNorm, MHA; MoE: routed experts; DeepSeek: MLA (caching its latent)."""
    model = tiny_model(preset)
    engine = Engine(model, block_size=4, num_blocks=12, max_batched_tokens=12, prefix_caching=False)
    check_against_full_recompute(model, engine, prompts(), SAMPLED)
    assert engine.scheduler.preemptions > 0


def test_prefix_caching_reuses_blocks_and_changes_nothing():
    model = tiny_model()
    shared = prompts([13])[0]
    tails = prompts([3, 1, 7, 4, 9], seed=1)
    with_prefix = [shared + tail for tail in tails]
    cached = Engine(model, block_size=4, num_blocks=20, max_batched_tokens=12, prefix_caching=True)
    check_against_full_recompute(model, cached, with_prefix, SAMPLED)
    assert cached.scheduler.cached_tokens >= 4 * 12   # the later requests found the shared 3 blocks
    plain = Engine(model, block_size=4, num_blocks=20, max_batched_tokens=12, prefix_caching=False)
    assert [c.token_ids for c in plain.generate(with_prefix, SAMPLED)] == \
        [c.token_ids for c in cached.generate(with_prefix, SAMPLED)]


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_outputs_stream_and_finish_for_their_reasons(decode_steps):
    """One token per output when each step goes through the host; with greedy steps run back to
    back the same tokens in bursts, each request cut at its own end (EOS, stop token, length)."""
    model = tiny_model()
    prompt = prompts([6])[0]
    reference = Engine(model, decode_steps=1).generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    reference = reference[0].token_ids
    eos = reference[4]
    first = reference.index(eos)
    engine = Engine(model, eos_token_ids=[eos], decode_steps=decode_steps)
    engine.add_request("eos", prompt, SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("ignore", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_request("stop", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                      stop_token_ids=(reference[2],)))
    engine.add_request("min", prompt, SamplingParams(max_tokens=12, temperature=0, min_tokens=first + 2))
    streams = {rid: [] for rid in ("eos", "ignore", "stop", "min")}
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert (len(output.token_ids) == 1 or decode_steps > 1) and output.prompt_tokens == 6
            streams[output.request_id] += output.token_ids
            assert output.completion_tokens == len(streams[output.request_id])
            if output.finished:
                finished[output.request_id] = output.finish_reason
    assert streams["eos"] == reference[:first + 1] and finished["eos"] == "stop"   # EOS included
    assert streams["ignore"] == reference and finished["ignore"] == "length"
    assert streams["stop"] == reference[:reference.index(reference[2]) + 1] and finished["stop"] == "stop"
    assert len(streams["min"]) >= first + 2 and eos not in streams["min"][:first + 1]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek"])
def test_greedy_steps_back_to_back_give_the_tokens_of_single_steps(preset):
    """Bursts of up to 5 greedy steps between two looks of the host: the same tokens as one step
    at a time, through block boundaries (blocks of 4), requests ending at different steps, a
    cache small enough that a burst's blocks are sometimes refused (and requests preempted),
    and prefix-cache names given to the blocks a burst filled (a second round finds them)."""
    model = tiny_model(preset)
    prompt_list = prompts((5, 30, 1, 17, 9, 12))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 8, 25, 6, 11, 3)]
    expected = [c.token_ids for c in Engine(model, block_size=4, decode_steps=1).generate(prompt_list, params)]
    engine = Engine(model, block_size=4, num_blocks=24, max_batched_tokens=16, decode_steps=5, prefix_caching=True)
    runs = record_greedy_runs(engine)
    assert [c.token_ids for c in engine.generate(prompt_list, params)] == expected
    assert max(n for _, n in runs) == 5 and engine.scheduler.preemptions > 0
    cached = engine.scheduler.cached_tokens
    assert [c.token_ids for c in engine.generate(prompt_list, params)] == expected
    assert engine.scheduler.cached_tokens > cached


def test_requests_with_log_probs_penalties_or_a_queue_step_one_at_a_time():
    model = tiny_model()
    engine = Engine(model, max_requests=1, decode_steps=8)
    runs = record_greedy_runs(engine)
    for params in (SamplingParams(max_tokens=6, temperature=0, logprobs=0),
                   SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.2),
                   SamplingParams(max_tokens=6, temperature=0.7, seed=1)):
        engine.generate(prompts([4]), params)
    assert runs == []
    engine.generate(prompts([4, 7]), SamplingParams(max_tokens=6, temperature=0))   # the second waits for the first
    assert runs == [("start", 5)]   # the second request, alone after the first finished: its 6 - 1 tokens


def test_the_next_greedy_run_is_queued_before_the_host_reads_the_last():
    """Runs of the same rows follow each other without the host between them: the same tokens as
    one step at a time; a request that ends (EOS) in a run while the next is queued keeps its
    tokens up to its end, the others go on; a request aborted while its run is queued gets none
    of its tokens; a request that arrives waits only for the run in flight."""
    model = tiny_model()
    prompt_list = prompts((6, 3, 9))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = [c.token_ids for c in Engine(model, decode_steps=1).generate(prompt_list, [params] * 3)]
    engine = Engine(model, block_size=4, decode_steps=4)
    runs = record_greedy_runs(engine)
    assert [c.token_ids for c in engine.generate(prompt_list, [params] * 3)] == expected
    assert runs[:2] == [("start", 4), ("continue", 4)] and runs.count(("start", 4)) == 1   # 39 = 4 * 9 + 3
    assert runs[-1] == ("continue", 3)

    eos = expected[0][13]   # within the fourth run of 4
    first = expected[0].index(eos)
    engine = Engine(model, block_size=4, decode_steps=4, eos_token_ids=[eos])
    free = engine.cache.allocator.num_free
    for i, prompt in enumerate(prompt_list):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=i > 0))
    streams = {f"r{i}": [] for i in range(3)}
    while engine.has_unfinished_requests():
        for output in engine.step():
            streams[output.request_id] += output.token_ids
        if len(streams["r1"]) >= 20 and "late" not in streams:
            assert engine._greedy_run is not None   # a run of r1 is queued
            engine.abort_request("r1")
            engine.add_request("late", prompt_list[1], params)
            streams["late"], aborted_at = [], len(streams["r1"])
    assert streams["r0"] == expected[0][:first + 1]
    assert streams["r1"] == expected[1][:aborted_at] and aborted_at < 40
    assert streams["r2"] == expected[2] and streams["late"] == expected[1]
    engine.step()   # the last run queued, of finished requests only
    assert engine._greedy_run is None and engine.cache.allocator.num_free == free


def test_aborted_requests_finish_at_the_next_step_and_free_their_blocks():
    engine = Engine(tiny_model(), block_size=4, num_blocks=40)
    free = engine.cache.allocator.num_free
    engine.add_request("a", prompts([10])[0], SamplingParams(max_tokens=20))
    engine.add_request("b", prompts([10])[0], SamplingParams(max_tokens=20))
    engine.step()
    engine.abort_request("a")
    engine.abort_request("unknown")   # no-op
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert aborted[0].token_ids == [] and aborted[0].completion_tokens == 1
    assert all(o.request_id == "b" for o in engine.step())
    engine.abort_request("b")
    engine.step()
    assert not engine.has_unfinished_requests() and engine.cache.allocator.num_free == free


def test_more_requests_than_capacity_wait_and_come_back_in_order():
    engine = Engine(tiny_model(), max_requests=2)
    prompt_list = prompts((3, 8, 2, 5, 7, 4, 6))
    completions = engine.generate(prompt_list, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    alone = [Engine(tiny_model()).generate([p], SamplingParams(max_tokens=5, temperature=0))[0] for p in prompt_list]
    assert [c.prompt_token_ids for c in completions] == prompt_list
    assert [c.token_ids for c in completions] == [c.token_ids for c in alone]


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 256], SamplingParams(), "token id 256 is outside the vocabulary"),
    ([1] * 60, SamplingParams(max_tokens=5), "exceeds the maximum sequence length"),
    ([1], SamplingParams(top_p=0.0), "top_p must be"),
])
def test_bad_requests_are_refused_with_a_reason(prompt, params, match):
    engine = Engine(tiny_model())
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests()


def test_duplicate_ids_and_requests_larger_than_the_cache_are_refused():
    engine = Engine(tiny_model(), block_size=4, num_blocks=5)
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="needs more than the KV cache's 4 blocks"):
        engine.add_request("y", [1] * 10, SamplingParams(max_tokens=8))


def test_generate_wrapper_continues_a_batch_greedily():
    model = tiny_model().train()
    prompt = torch.tensor(prompts((6, 6)))
    out = generate(model, prompt, max_new_tokens=7, temperature=0)
    assert out.shape == (2, 13) and torch.equal(out[:, :6], prompt) and model.training
    with torch.no_grad():
        expected = model.eval()(out[:, :-1])[:, 5:].argmax(dim=-1)
    assert torch.equal(out[:, 6:], expected)


def test_warm_up_leaves_the_engine_as_it_found_it():
    """After warm_up the engine is idle, every block is free or reusable, and requests (greedy and
    seedless sampled ones) come out as from an engine that was never warmed up."""
    model = tiny_model()
    requests = prompts((17, 7), seed=3)
    params = [SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=6, temperature=0.8)]
    expected = Engine(model, seed=7).generate(requests, params)
    engine = Engine(model, seed=7)
    assert engine.warm_up() >= 0 and not engine.has_unfinished_requests()
    assert engine.cache.allocator.num_free == engine.cache.num_blocks - 1   # all but the null block
    assert [c.token_ids for c in engine.generate(requests, params)] == [c.token_ids for c in expected]
    engine.add_request("queued", requests[0], params[0])
    with pytest.raises(ValueError, match="idle engine"):
        engine.warm_up()
