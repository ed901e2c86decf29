"""The streamed answers of `tessera serve`: server-sent events of OpenAI's completion and chat chunks.

`data: {json}` per chunk, then `data: [DONE]`. Once the headers are sent an error can no longer be
a status: it becomes an event with OpenAI's error body (a deadline's 408, a drain's 503).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, AsyncIterator

from fastapi.responses import StreamingResponse

from tessera.inference.admission import RETRY_AFTER
from tessera.inference.async_engine import EngineDeadError, RequestStream
from tessera.inference.protocol import APIError, SamplingFields

if TYPE_CHECKING:
    from tessera.inference.server import Server, _Choice


def sse(chunk: dict | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


def event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except (APIError, EngineDeadError) as exc:   # the headers are sent: the error becomes an event
            yield sse(as_api_error(exc).body())
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def as_api_error(exc: APIError | EngineDeadError) -> APIError:
    if isinstance(exc, APIError):
        return exc
    return APIError(str(exc), status=503, kind="server_error", headers=RETRY_AFTER)


async def answer_chunks(server: Server, body: SamplingFields, header: dict, stream: RequestStream,
                        choices: list[_Choice], prompts: list[list[int]], *, chat: bool,
                        openings: list[dict | None]) -> AsyncIterator[dict]:
    """The streamed chunks of completions (`text` deltas) or chat (`delta` messages): an opening
    chunk per choice where given, the deltas, a last chunk with the finish reason, the usage."""
    logprobs_of = server.chat_logprobs if chat else server.completion_logprobs

    def chunk(choice: _Choice, content: dict, logprobs=None, finish_reason=None) -> dict:
        return {**header, "choices": [{"index": choice.index, **content, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]}

    def text(value: str | None) -> dict:
        if chat:
            return {"delta": {} if value is None else {"content": value}}
        return {"text": value or ""}

    for choice, opening in zip(choices, openings):
        if opening is not None:
            yield chunk(choice, opening)
    async for choice, delta in server.deltas(stream, choices):
        if delta.text or (delta.token_ids and choice.params.logprobs is not None):
            yield chunk(choice, text(delta.text), logprobs_of(choice, delta))
        if delta.finished:
            last = chunk(choice, text(None), finish_reason=delta.finish_reason)
            last["choices"][0].update(server.token_ids(body, choice))
            yield last
    if body.stream_options is not None and body.stream_options.include_usage:
        yield {**header, "choices": [], "usage": server.usage(prompts, choices)}
