"""AsyncEngine: the real Engine stepped in a background thread, read by many asyncio tasks.

The oracle is the engine's own `generate()` on the same prompts (greedy), run synchronously.
"""

import asyncio

import pytest

from tessera.inference.async_engine import AsyncEngine, EngineDeadError
from tessera.inference.sampling import SamplingParams
from tests.inference.tiny_text_model import CORPUS, hf_dir, tiny_engine, tokenizer  # noqa: F401 -- fixtures

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(hf_dir, tokenizer):
    return tiny_engine(hf_dir, tokenizer, max_requests=2)   # fewer slots than requests: the rest must wait


def _prompts(tokenizer):
    return [tokenizer.encode(text[: 5 + 4 * i]) for i, text in enumerate(CORPUS * 2)]


async def _tokens(async_engine, request_id, prompt, params):
    stream = await async_engine.add_requests([(request_id, prompt, params)])
    tokens = []
    async for output in stream:
        tokens += output.token_ids
        last = output
    return tokens, last.finish_reason


def test_concurrent_requests_beyond_capacity_all_get_the_engines_own_answer(engine, tokenizer):
    prompts = _prompts(tokenizer)
    expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            return await asyncio.gather(*(_tokens(async_engine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)))
        finally:
            async_engine.shutdown()

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(reason == "length" for _, reason in results)
    assert not engine.has_unfinished_requests()


def test_a_closed_stream_aborts_its_request_and_a_refused_one_raises(engine, tokenizer):
    seen = []
    step = engine.step

    def recording_step():
        outputs = step()
        seen.extend(outputs)
        return outputs

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        engine.step = recording_step
        try:
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            stream = await async_engine.add_requests([("long", tokenizer.encode("The quick"), long)])
            first = await stream.__anext__()
            stream.close()
            with pytest.raises(ValueError, match="exceeds the maximum sequence length"):
                await async_engine.add_requests([("too-long", [1] * 250, SamplingParams(max_tokens=10))])
            # the engine keeps serving: a request after both is answered in full
            tokens, reason = await _tokens(async_engine, "after", tokenizer.encode("hello"), GREEDY)
            return first, tokens, reason
        finally:
            async_engine.shutdown()
            del engine.step

    first, tokens, reason = asyncio.run(main())
    assert len(first.token_ids) >= 1 and len(tokens) == GREEDY.max_tokens and reason == "length"
    long_outputs = [o for o in seen if o.request_id == "long"]
    assert long_outputs[-1].finish_reason == "abort" and long_outputs[-1].completion_tokens < 200
    assert not engine.has_unfinished_requests()


def test_an_engine_failure_reaches_every_reader_and_stops_the_engine(engine, tokenizer):
    def broken_step():
        raise RuntimeError("device lost")

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        engine.step = broken_step
        try:
            with pytest.raises(EngineDeadError, match="device lost"):
                await _tokens(async_engine, "doomed", tokenizer.encode("hi"), GREEDY)
            assert not async_engine.alive
            with pytest.raises(EngineDeadError):
                await async_engine.add_requests([("late", tokenizer.encode("hi"), GREEDY)])
        finally:
            async_engine.shutdown()
            del engine.step

    asyncio.run(main())
    engine.abort_request("doomed")   # leave the shared engine clean for later tests
    while engine.has_unfinished_requests():
        engine.step()
