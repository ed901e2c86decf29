"""The HTTP server over real HTTP (uvicorn on a free port), with the `openai` client and with httpx.

The oracle for every answer is a second engine over the same model, run synchronously
(greedy); the text oracle is the tokenizer's decode of the answer's token ids.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tessera.inference.sampling import SamplingParams
from tessera.inference.server import create_app
from tests.inference.tiny_text_model import (  # noqa: F401 -- hf_dir, tokenizer: fixtures
    CORPUS, hf_dir, running_server, tiny_engine, tokenizer,
)

MODEL = "tiny"
NO_EOS = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def reference(hf_dir, tokenizer):
    """greedy(prompt ids, max_tokens, **params) -> token ids, from an engine of its own."""
    engine = tiny_engine(hf_dir, tokenizer, max_requests=32)

    def greedy(prompts, max_tokens, **params):
        many = isinstance(prompts[0], list)
        params = SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0), **params)
        out = [c.token_ids for c in engine.generate(prompts if many else [prompts], params)]
        return out if many else out[0]

    return greedy


@pytest.fixture(scope="module")
def served(hf_dir, tokenizer):
    app = create_app(tiny_engine(hf_dir, tokenizer, max_requests=8), tokenizer, model_name=MODEL)
    with running_server(app) as base:
        yield base, app.state.server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def test_completions_and_chat_answer_as_the_engine_does(client, tokenizer, reference):
    prompt = "The quick brown"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS)
    choice = answer.choices[0]
    ids = tokenizer.encode(prompt)
    assert choice.model_extra["token_ids"] == reference(ids, 12, ignore_eos=True)
    assert choice.text == tokenizer.decode(choice.model_extra["token_ids"])
    assert choice.finish_reason == "length" and answer.object == "text_completion" and answer.model == MODEL
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == \
        (len(ids), 12, len(ids) + 12)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    chat_ids = tokenizer.encode_chat(messages)
    assert chat.choices[0].model_extra["token_ids"] == reference(chat_ids, 10, ignore_eos=True)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tokenizer.decode(chat.choices[0].model_extra["token_ids"])
    assert chat.usage.prompt_tokens == len(chat_ids) and chat.object == "chat.completion"
    content = chat.choices[0].logprobs.content
    assert len(content) == 10 and all(len(entry.top_logprobs) == 2 for entry in content)
    # greedy: each chosen token is the most likely one
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)


def test_prompt_lists_n_choices_seeds_and_echo(client, tokenizer, reference):
    prompts = ["The quick", "tessera trains"]
    answer = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0.8, seed=11,
                                       echo=True, extra_body=NO_EOS)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:
        prompt = prompts[choice.index // 2]
        ids = tokenizer.encode(prompt)
        # choice j of a prompt is sampled with seed + j, exactly as the engine samples it
        expected = reference(ids, 6, temperature=0.8, seed=11 + choice.index % 2, ignore_eos=True)
        assert choice.model_extra["token_ids"] == expected
        assert choice.text == prompt + tokenizer.decode(expected)
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert answer.usage.completion_tokens == 4 * 6


def test_streams_add_up_to_the_non_streamed_answers(client):
    common = dict(model=MODEL, max_tokens=14, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="héllo wörld", **common).choices[0].text
    chunks = list(client.completions.create(prompt="héllo wörld", stream=True,
                                            stream_options={"include_usage": True}, **common))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14

    messages = [{"role": "user", "content": "你好"}]
    whole = client.chat.completions.create(messages=messages, **common).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **common))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_server_sent_events_on_the_wire(served):
    base, _ = served
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 6, "stream": True, "temperature": 0}
    with httpx.stream("POST", base + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: ") for event in events[:-1])
    assert all(p["object"] == "text_completion" and p["id"] == payloads[0]["id"] for p in payloads)


def test_megatron_put_api(served, tokenizer, reference):
    base, _ = served
    prompts = ["The quick", "tessera trains"]
    answer = httpx.put(base + "/api", json={"prompts": prompts, "tokens_to_generate": 8, "top_k": 1,
                                            "logprobs": True}).json()
    for prompt, tokens, text, logprobs in zip(prompts, answer["tokens"], answer["text"], answer["logprobs"]):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        generated = reference(ids, 8, temperature=1.0, top_k=1)
        assert tokens == ids + generated
        assert text == prompt + tokenizer.decode(generated)
        assert len(logprobs) == len(generated) and all(v <= 0 for v in logprobs)


def test_models_and_health(served):
    base, _ = served
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 256
    assert httpx.get(base + "/health").status_code == 200


def test_a_stop_string_ends_the_text_before_it(client, tokenizer, reference):
    prompt = "The quick brown"
    full = tokenizer.decode(reference(tokenizer.encode(prompt), 16, ignore_eos=True))
    stop = full[6:8]
    expected = full[:full.find(stop)]
    common = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    choice = client.completions.create(**common).choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(stream=True, **common))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_clients_all_get_their_own_answer(served, tokenizer, reference):
    prompts = [f"{CORPUS[i % len(CORPUS)][: 3 + i % 17]} {i}" for i in range(32)]
    lengths = [4 + i % 13 for i in range(32)]
    ids = [tokenizer.encode(p) for p in prompts]
    expected = [reference(p, n, ignore_eos=True) for p, n in zip(ids, lengths)]
    client = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)

    async def one(i):
        common = dict(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0, extra_body=NO_EOS)
        if i % 2:   # half of them stream
            chunks = [c async for c in await client.completions.create(stream=True, **common)]
            return [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []]
        return (await client.completions.create(**common)).choices[0].model_extra["token_ids"]

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    assert asyncio.run(main()) == expected


@pytest.fixture
def slow_engine(served):
    """The served engine, stepping slowly, recording every output."""
    engine = served[1].engine.engine
    step, seen = engine.step, []

    def slow_step():
        time.sleep(0.01)
        outputs = step()
        seen.extend(outputs)
        return outputs

    engine.step = slow_step
    yield engine, seen
    del engine.step


def _wait_idle(engine, seconds=20.0):
    deadline = time.monotonic() + seconds
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_client_that_disconnects_mid_stream_cancels_its_request(served, slow_engine, client):
    base, server = served
    engine, seen = slow_engine
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line).removeprefix("data: "))
        next(line for line in lines if line)
    _wait_idle(engine)
    mine = [o for o in seen if o.request_id == first["id"] + "-0"]
    assert mine[-1].finish_reason == "abort" and mine[-1].completion_tokens < 200
    assert server.engine.num_streams == 0
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].finish_reason


def test_a_non_streaming_client_that_gives_up_cancels_its_request(served, slow_engine):
    base, _ = served
    engine, seen = slow_engine
    body = {"model": MODEL, "prompt": "tessera", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    _wait_idle(engine)
    assert [o.finish_reason for o in seen if o.finished] == ["abort"]
    assert max(o.completion_tokens for o in seen) < 200


LONG = list(range(1, 301))
BAD = [  # (method, path, body, status, the field named)
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": [[1, 99999]]}, 400, None),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ["a", "b"], "n": 100}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
    ("PUT", "/api", {"prompts": []}, 400, "prompts"),
    ("PUT", "/api", {"prompts": ["x"], "temperature": 0}, 400, "temperature"),
    ("PUT", "/api", {"prompts": ["x"], "top_k": 5, "top_p": 0.9}, 400, "top_p"),
    ("PUT", "/api", {"prompts": ["x"], "beam_width": 2}, 400, "beam_width"),
    ("GET", "/v1/nothing-here", None, 404, None),
]


@pytest.mark.parametrize("method, path, body, status, param", BAD, ids=[f"{b[1]}:{str(b[2])[:40]}" for b in BAD])
def test_bad_input_is_a_4xx_with_an_openai_error_body_and_the_server_keeps_serving(served, method, path, body,
                                                                                     status, param):
    base, _ = served
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = httpx.request(method, base + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    assert httpx.get(base + "/health").status_code == 200


def test_the_openai_client_reads_the_error_and_the_server_answers_after_all_of_them(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert refused.value.status_code == 400 and "max_tokens" in refused.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
