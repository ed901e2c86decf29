"""DecodeGraphs' bookkeeping on the CPU: buckets, input buffers, greedy runs queued one after
another, captures in the middle of a chain. CUDA graphs themselves need a GPU (tests/gpu), so
here the CUDA API is stood in for: a "capture" runs the step once and remembers it, a "replay"
runs it again on the same buffers, events and streams do nothing (everything is in order on
the CPU). What this holds is the code around the graphs, against the engine without them."""

import contextlib
import functools

import pytest
import torch

from tessera.inference import cuda_graphs
from tessera.inference.engine import Engine
from tessera.inference.runner import decode_logits
from tessera.inference.sampling import SamplingParams
from tests.inference.test_engine import prompts, tiny_model


class _Nothing:
    def wait_stream(self, stream):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Graph:
    """Replays the step that ran while it was "captured", into the same output tensor."""

    def replay(self):
        step, inputs, logits = self.body
        logits.copy_(step(*inputs))

    def pool(self):
        return None


@pytest.fixture
def stand_in_cuda(monkeypatch):
    capturing = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing.append(g)
        yield
        capturing.pop()

    def unpinned(make):
        return functools.wraps(make)(lambda *args, pin_memory=False, **kwargs: make(*args, **kwargs))

    step = cuda_graphs.DecodeGraphs._step

    def recording_step(self, *inputs):
        logits = step(self, *inputs)
        if capturing:
            capturing[-1].body = (functools.partial(step, self), inputs, logits)
        return logits

    for name, value in (("Stream", _Nothing), ("current_stream", _Nothing), ("Event", _Nothing),
                        ("CUDAGraph", _Graph), ("graph", graph), ("stream", lambda s: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch, "zeros", unpinned(torch.zeros))
    monkeypatch.setattr(torch, "empty", unpinned(torch.empty))
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_step", recording_step)


@pytest.mark.parametrize("decode_steps", [4, 16])
def test_graphed_greedy_runs_give_the_tokens_of_the_engine_without_graphs(stand_in_cuda, decode_steps):
    """Three requests of 40 greedy tokens: runs queued while the host reads the last, through a
    block-table bucket that grows mid-chain (a capture between two runs of a chain), then one
    request alone (another row bucket)."""
    model = tiny_model()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt_list = prompts((6, 3, 9))
    expected = [c.token_ids for c in Engine(model, decode_steps=1).generate(prompt_list, [params] * 3)]
    engine = Engine(model, block_size=4, decode_steps=decode_steps)
    engine.runner.graphs = cuda_graphs.DecodeGraphs(
        lambda ids, positions, tables: decode_logits(model, engine.cache, ids, positions, tables), max_rows=64,
        max_blocks=16, device=torch.device("cpu"), vocab_size=engine.vocab_size, max_steps=decode_steps,
        compile=False)
    assert [c.token_ids for c in engine.generate(prompt_list, [params] * 3)] == expected
    assert [c.token_ids for c in engine.generate(prompt_list[:1], [params])] == expected[:1]
    shapes = set(engine.runner.graphs.graphs)
    assert {(4, 8, True), (4, 16, True), (1, 16, True)} <= shapes   # 12 blocks of 4 by the end


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_warm_up_captures_one_request_at_every_width_and_the_request_then_captures_nothing(stand_in_cuda,
                                                                                          decode_steps):
    """After warm_up, a request alone grows from 5 to 60 tokens (blocks of 4: widths 2 to 16) on the
    graphs already captured, greedily and sampled, with the tokens of the engine without graphs."""
    model = tiny_model()
    params = [SamplingParams(max_tokens=55, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=55, temperature=0.7, ignore_eos=True, seed=3)]
    prompt_list = prompts((5, 5))
    expected = [c.token_ids for c in Engine(model, block_size=4, decode_steps=1).generate(prompt_list, params)]
    engine = Engine(model, block_size=4, decode_steps=decode_steps, max_seq_length=64)
    engine.runner.graphs = graphs = cuda_graphs.DecodeGraphs(
        lambda ids, positions, tables: decode_logits(model, engine.cache, ids, positions, tables), max_rows=64,
        max_blocks=16, device=torch.device("cpu"), vocab_size=engine.vocab_size, max_steps=decode_steps,
        compile=False)
    engine.warm_up()
    greedy = (False, True) if decode_steps > 1 else (False,)
    assert {(1, width, g) for width in (1, 2, 4, 8, 16) for g in greedy} <= set(graphs.graphs)
    captured = len(graphs.graphs)
    for prompt, param, tokens in zip(prompt_list, params, expected):
        assert engine.generate([prompt], param)[0].token_ids == tokens
    assert len(graphs.graphs) == captured
