"""`tessera serve` under load and against strangers, over real HTTP: keys, bounded admission, limits,
deadlines, /metrics and the drain.

Oracles: transformers' greedy `generate()` for the answers that are served, prometheus-client's
parser for /metrics, the openai client's own error classes. The engine is the real one over a
tiny model, behind a gate the tests hold shut to keep requests waiting (so "full" is exact, not
a race) and, for deadlines, a pause per step (so a request is running when its deadline hits).
"""

import asyncio
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import transformers
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tessera.config.inference import ServeConfig
from tessera.inference.drain import DrainingServer
from tessera.inference.server import create_app
from tests.inference.tiny_text_model import hf_dir, running_server, tiny_engine, tokenizer  # noqa: F401 -- fixtures
from tests.ports import free_port

KEYS = ["first-key", "second-key"]
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
RUNNING, QUEUED = 4, 8
PROMPT = "The quick brown"
NEW_TOKENS = 8
GREEDY = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


class GatedEngine:
    """The engine, stepped only while `gate` is open and `pause` seconds after each step."""

    def __init__(self, engine, pause: float = 0.0):
        self.engine, self.pause = engine, pause
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def has_unfinished_requests(self) -> bool:   # False: the engine thread waits for commands
        return self.gate.is_set() and self.engine.has_unfinished_requests()

    def step(self):
        outputs = self.engine.step()
        time.sleep(self.pause)
        return outputs


def _open(gated: GatedEngine, app) -> None:
    gated.gate.set()
    app.state.server.engine.abort("wake-up")   # an unknown id: a no-op that wakes the engine thread


def _serve(hf_dir, tokenizer, pause: float = 0.0, **serving):
    gated = GatedEngine(tiny_engine(hf_dir, tokenizer, max_requests=RUNNING, decode_steps=1), pause)
    config = ServeConfig(api_key=KEYS, max_queued_requests=QUEUED, **serving)
    return gated, create_app(gated, tokenizer, model_name="tiny", serving=config)


@pytest.fixture(scope="module")
def guarded(hf_dir, tokenizer):
    gated, app = _serve(hf_dir, tokenizer, max_request_bytes=4096)
    with running_server(app) as base:
        yield base, gated, app


@pytest.fixture(scope="module")
def expected_ids(hf_dir, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def _scrape(base: str) -> dict:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.02)


def _gauge(base: str, name: str) -> float:
    return _scrape(base)[(f"tessera:{name}", ())]


def test_every_route_but_health_needs_a_key(guarded):
    base = guarded[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("GET", "/no-such-route")):
            answer = httpx.request(method, base + path, headers=headers, json=GREEDY)
            assert answer.status_code == 401 and answer.headers["WWW-Authenticate"] == "Bearer"
            assert answer.json()["error"]["code"] == "invalid_api_key"
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(base + "/health").status_code == 200
    for key in KEYS:
        assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEYS[0], max_retries=0)
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


async def _flood(base: str, clients: int, gated: GatedEngine, app) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120, limits=limits) as client:
        requests = [asyncio.ensure_future(client.post("/v1/completions", json=GREEDY)) for _ in range(clients)]
        refused, deadline = clients - RUNNING - QUEUED, time.monotonic() + 60
        while sum(request.done() for request in requests) < refused:   # the gate holds the admitted ones
            assert time.monotonic() < deadline, f"{sum(r.done() for r in requests)} answered while the gate is shut"
            await asyncio.sleep(0.02)
        assert not any(request.done() and request.result().status_code == 200 for request in requests)
        _open(gated, app)
        return list(await asyncio.gather(*requests))


def test_a_flood_is_served_whole_or_told_to_retry(guarded, tokenizer, expected_ids):
    base, gated, app = guarded
    before = _scrape(base)
    gated.gate.clear()
    answers = asyncio.run(_flood(base, 120, gated, app))
    served = [answer for answer in answers if answer.status_code == 200]
    refused = [answer for answer in answers if answer.status_code != 200]
    assert len(served) == RUNNING + QUEUED and len(refused) == 120 - RUNNING - QUEUED
    for answer in served:
        choice = answer.json()["choices"][0]
        assert choice["token_ids"] == expected_ids and choice["text"] == tokenizer.decode(expected_ids)
    for answer in refused:
        assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.get(base + "/health").status_code == 200
    after = _scrape(base)
    count = lambda scrape, status: scrape.get(  # noqa: E731
        ("tessera:http_requests_total", (("route", "/v1/completions"), ("status", status))), 0)
    assert (count(after, "200") - count(before, "200"), count(after, "429") - count(before, "429")) == (12, 108)


async def _leave_while_queued(base: str, gated: GatedEngine, app) -> list[int]:
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120,
                                 limits=httpx.Limits(max_connections=20)) as client:
        stream = {**GREEDY, "stream": True}
        held = [asyncio.ensure_future(client.post("/v1/completions", json=stream if i % 2 else GREEDY))
                for i in range(RUNNING + QUEUED)]
        await asyncio.to_thread(_wait_for, lambda: _gauge(base, "num_requests_waiting") == RUNNING + QUEUED)
        assert (await client.post("/v1/completions", json=GREEDY)).status_code == 429
        for leaving in held[:2]:   # a request and a stream whose clients go away while queued
            leaving.cancel()
        await asyncio.to_thread(_wait_for, lambda: _gauge(base, "num_requests_waiting") == RUNNING + QUEUED - 2)
        newcomers = [asyncio.ensure_future(client.post("/v1/completions", json=GREEDY)) for _ in range(2)]
        await asyncio.to_thread(_wait_for, lambda: _gauge(base, "num_requests_waiting") == RUNNING + QUEUED)
        _open(gated, app)
        return [answer.status_code for answer in await asyncio.gather(*held[2:], *newcomers)]


def test_a_client_that_leaves_while_queued_frees_its_place_at_once(guarded):
    base, gated, app = guarded
    gated.gate.clear()
    assert asyncio.run(_leave_while_queued(base, gated, app)) == [200] * (RUNNING + QUEUED)


def test_limits_answer_4xx_and_the_server_keeps_serving(guarded):
    base = guarded[0]
    big = {**GREEDY, "prompt": "x" * 5000}
    answer = httpx.post(base + "/v1/completions", headers=AUTH, json=big)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"

    def chunks():   # no Content-Length: the limit is found while reading
        body = json.dumps(big).encode()
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    assert httpx.post(base + "/v1/completions", headers=AUTH, content=chunks()).status_code == 413
    answer = httpx.post(base + "/v1/completions", headers=AUTH, json={**GREEDY, "n": RUNNING + QUEUED + 1})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"
    answer = httpx.post(base + "/v1/completions", headers=AUTH, json={**GREEDY, "max_tokens": 10_000})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    answer = httpx.post(base + "/v1/completions", headers=AUTH, json=GREEDY)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == NEW_TOKENS


def test_metrics_parse_and_add_up_to_the_requests_sent(guarded):
    base = guarded[0]
    before = _scrape(base)
    answers = [httpx.post(base + "/v1/completions", headers=AUTH, json={**GREEDY, "max_tokens": n}).json()
               for n in (2, 3, 5)]
    statuses = [httpx.post(base + "/v1/completions", json=GREEDY).status_code,
                httpx.post(base + "/v1/completions", headers=AUTH, content=b"{not json").status_code]
    assert statuses == [401, 400]
    after = _scrape(base)

    def delta(name: str, **labels) -> float:
        key = (f"tessera:{name}", tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("http_requests_total", route="/v1/completions", status="200") == 3
    assert delta("http_requests_total", route="/v1/completions", status="401") == 1
    assert delta("http_requests_total", route="/v1/completions", status="400") == 1
    assert delta("prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert delta("generation_tokens_total") == sum(a["usage"]["completion_tokens"] for a in answers) == 10
    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("time_to_first_token_seconds_count") == delta("e2e_request_latency_seconds_count") == 3
    assert delta("inter_token_latency_seconds_count") == 10 - 3   # every token after a request's first
    assert after[("tessera:num_requests_running", ())] == after[("tessera:kv_cache_blocks_used", ())] == 0


@pytest.fixture(scope="module")
def deadlined(hf_dir, tokenizer):
    gated, app = _serve(hf_dir, tokenizer, pause=0.05, request_timeout=1.0)
    with running_server(app) as base:
        yield base


def test_a_request_past_its_deadline_is_cut_and_frees_its_kv_blocks(deadlined):
    base = deadlined
    long = {**GREEDY, "max_tokens": 200}   # 200 steps of 50 ms at least: past the 1 s deadline
    answer = httpx.post(base + "/v1/completions", headers=AUTH, json=long, timeout=60)
    assert answer.status_code == 408 and answer.json()["error"]["code"] == "request_timeout"
    _wait_for(lambda: _gauge(base, "kv_cache_blocks_used") == 0)
    events = []
    with httpx.stream("POST", base + "/v1/completions", headers=AUTH, json={**long, "stream": True},
                      timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    assert _gauge(base, "kv_cache_blocks_used") > 0   # running, its blocks held
    assert events[-1]["error"]["code"] == "request_timeout"
    assert 0 < sum(len(event["choices"][0]["text"]) for event in events[:-1])
    _wait_for(lambda: _gauge(base, "kv_cache_blocks_used") == 0 and _gauge(base, "num_requests_running") == 0)
    assert httpx.post(base + "/v1/completions", headers=AUTH, json=GREEDY, timeout=60).status_code == 200


def test_a_drain_refuses_newcomers_and_cuts_what_outlives_its_timeout(hf_dir, tokenizer):
    gated, app = _serve(hf_dir, tokenizer, drain_timeout=0.3)
    drained = []

    async def drain():
        drained.append(await app.state.server.drain(0.3))

    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(lambda: server.started)
    base = f"http://127.0.0.1:{port}"
    gated.gate.clear()
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(client.post, "/v1/completions", json=GREEDY) for _ in range(2)]
            _wait_for(lambda: _gauge(base, "num_requests_waiting") == 2)
            server.handle_exit(signal.SIGTERM, None)
            _wait_for(lambda: httpx.get(base + "/health").status_code == 503)
            newcomer = client.post("/v1/completions", json=GREEDY)
            assert newcomer.status_code == 503 and newcomer.headers["Retry-After"] == "1"
            cut = [future.result() for future in held]
    thread.join(timeout=60)
    assert not thread.is_alive() and drained == [(0, 2)]
    assert [answer.status_code for answer in cut] == [503, 503]
    assert all("--drain-timeout" in answer.json()["error"]["message"] for answer in cut)
