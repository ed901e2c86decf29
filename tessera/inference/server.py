"""`tessera serve`'s HTTP API: OpenAI-compatible completions and chat, and Megatron's `PUT /api`.

A thin FastAPI layer over `AsyncEngine`: a request is checked (tessera.inference.protocol),
tokenized (through its chat template for chat), queued into the engine as one engine
request per choice, and answered as JSON or streamed as server-sent events
(tessera.inference.streaming). A client that goes away cancels its requests.

    POST /v1/completions, /v1/chat/completions   OpenAI's schemas (with vLLM's extras: top_k, min_p, ...)
    GET  /v1/models, /health                     the served model; 200 while the engine runs, else 503
    GET  /metrics                                Prometheus's text format (tessera.inference.metrics)
    PUT  /api                                    Megatron-LM's text generation server

What guards them (ServeConfig's flags): API keys (tessera.inference.auth), bounded admission
and the body-size limit (tessera.inference.admission), a deadline per request, and the drain
on SIGTERM (tessera.inference.drain). Every refusal is OpenAI's error body `{"error":
{"message", "type", "param", "code"}}` with a 4xx status (503 when the engine has stopped or
the server drains).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.config.inference import ServeConfig
from tessera.inference.admission import RETRY_AFTER, Admission, read_body
from tessera.inference.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tessera.inference.auth import RequireKey
from tessera.inference.metrics import CountResponses, ServerMetrics
from tessera.inference.protocol import (
    MAX_CHOICES, MEGATRON_UNSUPPORTED, APIError, ChatCompletionRequest, CompletionRequest, MegatronRequest, SamplingFields,
    clean_logprob, parse_request,
)
from tessera.inference.sampling import SamplingParams
from tessera.inference.streaming import answer_chunks, as_api_error, event_stream
from tessera.inference.text import ChatTemplateError, RequestText, TextDelta, TextTokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's
CLIENT_CLOSED_REQUEST = 499           # nginx's status for it; nobody receives it


@dataclass
class _Choice:
    """One engine request of an HTTP request, and what it has produced so far."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: RequestText      # the text, tokens and log-probs so far
    text_offset: int = 0   # where the next token's text starts (completions' log-probs)
    started: float = 0.0   # event-loop time of its admission
    last_output: float | None = None


class Server:
    """What the routes share: the engine, the tokenizer, checks and the shapes of answers."""

    def __init__(self, engine: AsyncEngine, tokenizer: TextTokenizer, model_name: str, serving: ServeConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_length = engine.engine.max_seq_length
        self.hidden_token_ids = set(engine.engine.eos_token_ids) | set(tokenizer.eos_token_ids)
        self.created = int(time.time())
        core = getattr(engine.engine, "engine", engine.engine)   # a lockstep.Leader wraps rank 0's engine
        self.admission = Admission(engine, core.scheduler.max_requests, serving.max_queued_requests)
        self.metrics = ServerMetrics(core)
        self.max_request_bytes, self.request_timeout = serving.max_request_bytes, serving.request_timeout

    async def read(self, request: Request, model: type, refuse: tuple[str, ...] = ()):
        """The request's body as `model` (tessera.inference.protocol), within --max-request-bytes."""
        return parse_request(model, await read_body(request, self.max_request_bytes), refuse)

    def check_model(self, fields: SamplingFields) -> None:
        if fields.model is not None and fields.model != self.model_name:
            raise APIError(f"The model '{fields.model}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")

    def room(self, prompt: list[int], max_tokens: int | None, prompt_field: str) -> int:
        """max_tokens checked against the context (None: all the room the prompt leaves)."""
        if not prompt:
            raise APIError(f"'{prompt_field}' is empty: at least one prompt token is needed", param=prompt_field)
        room = self.max_seq_length - len(prompt)
        if room < 1:
            raise APIError(f"This model's maximum context length is {self.max_seq_length} tokens, but the prompt has "
                           f"{len(prompt)}: it must leave room for one new token", param=prompt_field,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"This model's maximum context length is {self.max_seq_length} tokens, but "
                           f"{len(prompt)} prompt tokens and {max_tokens} max_tokens were requested",
                           param="max_tokens", code="context_length_exceeded")
        return room if max_tokens is None else max_tokens

    def choices(self, prefix: str, prompts: list[list[int]], n: int, stop: list[str],
                make_params: Callable[[list[int], int], SamplingParams]) -> list[_Choice]:
        """n choices per prompt; `make_params(prompt, j)` gives the SamplingParams of choice j."""
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(f"{len(prompts)} prompts x n={n} choices: at most {MAX_CHOICES} in one request", param="n")
        choices = []
        for prompt in prompts:
            for j in range(n):
                request_id = f"{prefix}-{len(choices)}"
                params = make_params(prompt, j)
                try:
                    params.validate()
                except ValueError as exc:
                    raise APIError(str(exc)) from None
                text = RequestText(self.tokenizer, prompt, stop=stop,
                                   skip_token_ids=self.hidden_token_ids | set(params.stop_token_ids),
                                   abort=lambda request_id=request_id: self.engine.abort(request_id))
                choices.append(_Choice(len(choices), request_id, prompt, params, text))
        return choices

    async def start(self, choices: list[_Choice]) -> RequestStream:
        """Admit the choices (or raise the refusal) and queue them into the engine."""
        self.admission.admit(len(choices))
        now = asyncio.get_running_loop().time()
        for choice in choices:
            choice.started = now
        try:
            stream = await self.engine.add_requests([(c.request_id, c.prompt_ids, c.params) for c in choices])
        except ValueError as exc:   # the engine's own checks (a token id outside the vocabulary, ...)
            raise APIError(str(exc)) from None
        self.metrics.prompt_tokens.inc(sum(len(choice.prompt_ids) for choice in choices))
        return stream

    async def _next_output(self, stream: RequestStream, deadline: float | None):
        """The stream's next output; 408 once `deadline` (event-loop time) has passed."""
        if deadline is None:
            return await anext(stream)
        try:
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError
            async with asyncio.timeout_at(deadline):
                return await anext(stream)
        except TimeoutError:
            raise APIError(f"the request ran past this server's --request-timeout ({self.request_timeout:g} s)",
                           status=408, code="request_timeout") from None

    async def drain(self, timeout: float) -> tuple[int, int]:
        """Refuse new requests and wait up to `timeout` seconds for those in flight; cut the rest.
        Returns (finished, cut), counted in engine requests."""
        self.admission.draining = True
        in_flight = self.engine.num_streams
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.engine.num_streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = self.engine.cut_all(EngineDeadError(f"the server is shutting down: --drain-timeout ({timeout:g} s) "
                                                  "passed before this request finished"))
        return in_flight - cut, cut

    async def deltas(self, stream: RequestStream, choices: list[_Choice]
                     ) -> AsyncIterator[tuple[_Choice, TextDelta]]:
        """(choice, delta) as outputs arrive; the stream is closed (what is left aborted) on exit."""
        by_id = {choice.request_id: choice for choice in choices}
        deadline = choices[0].started + self.request_timeout if self.request_timeout else None
        loop = asyncio.get_running_loop()
        try:
            while not stream.finished:
                output = await self._next_output(stream, deadline)
                choice, now = by_id[output.request_id], loop.time()
                self.metrics.output(choice.started, choice.last_output, now, len(output.token_ids),
                                    output.finish_reason)
                choice.last_output = now if output.token_ids else choice.last_output
                delta = choice.text.update(output)
                if delta is not None:
                    yield choice, delta
        finally:
            stream.close()

    async def collect(self, request: Request, stream: RequestStream, choices: list[_Choice]) -> bool:
        """Run the choices to their end (True), or abort them when the client disconnects (False)."""
        async def run() -> None:
            async for _ in self.deltas(stream, choices):
                pass

        work, gone = asyncio.ensure_future(run()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                stream.close()
        if work.cancelled():
            return False
        work.result()   # the engine's error, if it failed
        return True

    def usage(self, prompts: list[list[int]], choices: list[_Choice]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(choice.text.completion_tokens for choice in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def header(self, response_id: str, kind: str) -> dict:
        return {"id": response_id, "object": kind, "created": int(time.time()), "model": self.model_name}

    def completion_logprobs(self, choice: _Choice, delta: TextDelta | None = None) -> dict | None:
        """OpenAI's completions log-probs of a delta's tokens (or all the choice's)."""
        if choice.params.logprobs is None:
            return None
        source = delta or choice.text
        tokens = [self.tokenizer.token_text(t) for t in source.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        top = None
        if choice.params.logprobs > 0:
            top = [{self.tokenizer.token_text(t): clean_logprob(v) for t, v in entry.items()}
                   for entry in source.top_logprobs or []]
        return {"tokens": tokens, "token_logprobs": [clean_logprob(v) for v in source.logprobs or []],
                "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, choice: _Choice, delta: TextDelta | None = None) -> dict | None:
        """OpenAI's chat log-probs of a delta's tokens (or all the choice's)."""
        if choice.params.logprobs is None:
            return None
        source = delta or choice.text

        def entry(token_id: int, value: float) -> dict:
            token = self.tokenizer.token_text(token_id)
            return {"token": token, "logprob": clean_logprob(value), "bytes": list(token.encode("utf-8"))}

        tops = source.top_logprobs or [{}] * len(source.token_ids)
        return {"content": [{**entry(t, v), "top_logprobs": [entry(k, w) for k, w in top.items()]}
                            for t, v, top in zip(source.token_ids, source.logprobs or [], tops)]}

    def token_ids(self, body: SamplingFields, choice: _Choice) -> dict:
        if not body.return_token_ids:
            return {}
        return {"prompt_token_ids": choice.prompt_ids, "token_ids": choice.text.token_ids}


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _completion_prompts(server: Server, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [server.tokenizer.encode(prompt)]
    if not prompt:
        raise APIError("'prompt' is empty", param="prompt")
    if isinstance(prompt[0], str):
        return [server.tokenizer.encode(text) for text in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(ids) for ids in prompt]


def add_completions(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await server.read(request, CompletionRequest)
        server.check_model(body)
        if body.suffix or (body.best_of or 1) > 1:
            raise APIError("'suffix' and 'best_of' are not supported", param="suffix" if body.suffix else "best_of")
        if body.echo and body.logprobs is not None:
            raise APIError("'echo' with 'logprobs' is not supported (no log-probs of prompt tokens)", param="echo")
        prompts = _completion_prompts(server, body.prompt)

        def params(prompt: list[int], j: int) -> SamplingParams:
            max_tokens = server.room(prompt, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
            return SamplingParams(max_tokens=max_tokens, logprobs=body.logprobs, **body.sampling_kwargs(j))

        response_id = f"cmpl-{uuid.uuid4().hex}"
        choices = server.choices(response_id, prompts, body.n or 1, body.stop_strings(), params)
        echoes = [server.tokenizer.decode(c.prompt_ids) if body.echo else "" for c in choices]
        for choice, echo in zip(choices, echoes):
            choice.text_offset = len(echo)
        stream = await server.start(choices)
        header = server.header(response_id, "text_completion")
        if body.stream:
            return event_stream(answer_chunks(server, body, header, stream, choices, prompts, chat=False,
                                         openings=[{"text": echo} if echo else None for echo in echoes]))
        if not await server.collect(request, stream, choices):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return {**header, "usage": server.usage(prompts, choices), "choices": [
            {"index": c.index, "text": echo + c.text.text, "logprobs": server.completion_logprobs(c),
             "finish_reason": c.text.finish_reason, **server.token_ids(body, c)} for c, echo in zip(choices, echoes)]}


def add_chat(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await server.read(request, ChatCompletionRequest)
        server.check_model(body)
        if body.tools:
            raise APIError("'tools' are not supported", param="tools")
        try:
            prompt = server.tokenizer.encode_chat([message.as_template_input() for message in body.messages])
        except ChatTemplateError as exc:
            raise APIError(str(exc), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None

        def params(prompt: list[int], j: int) -> SamplingParams:
            return SamplingParams(max_tokens=server.room(prompt, max_tokens, "messages"), logprobs=logprobs,
                                  **body.sampling_kwargs(j))

        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = server.choices(response_id, [prompt], body.n or 1, body.stop_strings(), params)
        stream = await server.start(choices)
        header = server.header(response_id, "chat.completion")
        if body.stream:
            opening = {"delta": {"role": "assistant", "content": ""}}
            return event_stream(answer_chunks(server, body, {**header, "object": "chat.completion.chunk"}, stream,
                                         choices, [prompt], chat=True, openings=[opening] * len(choices)))
        if not await server.collect(request, stream, choices):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return {**header, "usage": server.usage([prompt], choices), "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text.text},
             "logprobs": server.chat_logprobs(c), "finish_reason": c.text.finish_reason,
             **server.token_ids(body, c)} for c in choices]}


def add_megatron_api(app: FastAPI, server: Server) -> None:
    """PUT /api: Megatron-LM's request and response (text and tokens include the prompt's)."""

    @app.put("/api")
    async def megatron_generate(request: Request):
        body = await server.read(request, MegatronRequest, refuse=MEGATRON_UNSUPPORTED)
        if body.top_k > 0 and body.top_p > 0:
            raise APIError("cannot set both top_k and top_p", param="top_p")
        prompts = [server.tokenizer.encode(text, add_special_tokens=body.add_BOS) for text in body.prompts]
        stop = ["\n\n"] * body.stop_on_double_eol + ["\n"] * body.stop_on_eol
        stop_token_ids = () if body.stop_token is None else (body.stop_token,)

        def params(prompt: list[int], _j: int) -> SamplingParams:
            # like Megatron, more new tokens than the context holds are cut to what fits
            max_tokens = min(body.tokens_to_generate, server.room(prompt, None, "prompts"))
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                  top_p=body.top_p or 1.0, seed=body.random_seed, stop_token_ids=stop_token_ids,
                                  logprobs=0 if body.logprobs else None)

        choices = server.choices(f"api-{uuid.uuid4().hex}", prompts, 1, stop, params)
        stream = await server.start(choices)
        if not await server.collect(request, stream, choices):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        answer = {"text": [text + c.text.text for text, c in zip(body.prompts, choices)],
                  "tokens": [c.prompt_ids + c.text.token_ids for c in choices]}
        if body.logprobs:
            answer["logprobs"] = [[clean_logprob(v) for v in c.text.logprobs] for c in choices]
        return answer


def add_info(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "tessera", "max_model_len": server.max_seq_length}]}

    @app.get("/health")
    async def health():
        if server.admission.draining:
            raise APIError("the server is shutting down", status=503, kind="server_error", headers=RETRY_AFTER)
        if server.engine.alive:
            return {"status": "ok"}
        raise APIError(f"the engine is not running ({server.engine.error!r})", status=503, kind="server_error")

    @app.get("/metrics")
    async def metrics():
        return server.metrics.response()


def create_app(engine, tokenizer: TextTokenizer, *, model_name: str, serving: ServeConfig | None = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The app serving `engine` (a tessera.inference.engine.Engine) as `model_name`, with the keys
    and limits of `serving` (its defaults when None: no key, unless $TESSERA_API_KEY sets one).

    The engine's thread starts and stops with the app (its lifespan); `on_shutdown` runs after
    it stops, however the server stopped (after SIGINT uvicorn raises the signal again once it
    has shut down, and code after its `run` does not run).
    """
    async_engine = AsyncEngine(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            if on_shutdown is not None:
                on_shutdown()

    serving = serving or ServeConfig()
    app = FastAPI(title="tessera", lifespan=lifespan)
    server = Server(async_engine, tokenizer, model_name, serving)
    app.state.server = server

    @app.exception_handler(APIError)
    @app.exception_handler(EngineDeadError)   # the engine stopped, or a drain cut the request
    async def api_error(_request: Request, exc: APIError | EngineDeadError) -> JSONResponse:
        error = as_api_error(exc)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(APIError(str(exc.detail), status=exc.status_code, kind=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, exc: Exception) -> JSONResponse:   # logged by uvicorn too
        error = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    for add in (add_completions, add_chat, add_megatron_api, add_info):
        add(app, server)
    if serving.api_key:
        app.add_middleware(RequireKey, keys=serving.api_key)
    app.add_middleware(CountResponses, metrics=server.metrics,   # outermost: counts the 401s too
                       routes=frozenset(route.path for route in app.routes))
    return app
