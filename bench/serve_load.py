"""Load on `tessera serve`: many concurrent streaming clients; aggregate tokens/s and time to first token.

    python bench/serve_load.py --url http://127.0.0.1:8000 --clients 64 --requests 256 --out serve.json
    python bench/serve_load.py --clients 64 --out serve.json -- --hf HF_DIR --port 8000   # starts the server too
    python bench/serve_load.py --flood --clients 256 -- --hf HF_DIR --port 8000 --max-queued-requests 64

Each client sends streaming /v1/completions requests one after the other (`ignore_eos`, so
every request makes exactly --max-tokens tokens) with a prompt of about --prompt-tokens
tokens, distinct per request and from other runs' (the warm-up's, an earlier bench's) so that
no prefix cache hides prefill. Reported: aggregate generated tokens/s over the whole run (first
request sent to last token received), median and p99 time to first token (from sending the
request to the first chunk with text), the median time between two streamed chunks per request
(a chunk is one engine output: with greedy runs up to --inference-decode-steps tokens, so this
is not a per-token time), and the count of failed requests (HTTP errors, error events, short
answers). With arguments after `--`, `tessera serve` is started with them, waited for (on its
--host and --port), and stopped at the end; --api-key (or $TESSERA_API_KEY) is sent as the bearer key.

--flood: more clients than the server admits (--inference-max-requests + --max-queued-requests).
A request told to retry (429 or 503 with Retry-After) waits as long as it says and is sent again.
Reported: requests served whole, answers that said retry, requests lost (anything else: an
error, a dropped connection, a short answer; the server promises none), and the time to first
token of the served (from the send of the attempt that was served).

The limits' cost on one H200 (config B's shape), in one call: 64 clients, which never meet the
limits, then 256 clients against 64 running + 64 queued; the served tokens/s of the second
should be within 2% of the first's, with 0 lost:

    python3 bench/serve_model.py /tmp/b && \
    python3 bench/serve_load.py --clients 64 --requests 256 --warmup 64 --out serve64.json \
        -- --hf /tmp/b --port 8011 --inference-max-seq-length 1024 && \
    python3 bench/serve_load.py --flood --clients 256 --requests 1024 --warmup 64 --out flood256.json \
        -- --hf /tmp/b --port 8011 --inference-max-seq-length 1024 --max-queued-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from gpu_state import GpuSampler

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "in the old town square near the river").split()


def _prompt(run: str, index: int, tokens: int) -> str:
    """About `tokens` tokens of words (a word is about one token), starting with the run's tag and the
    request's number: no two requests, of this run or another (the warm-up's, an earlier bench's
    against the same server), share a first KV block, so the prefix cache finds nothing."""
    words = [WORDS[(index * 7 + i) % len(WORDS)] for i in range(max(tokens - 5, 1))]
    return f"[{run}-{index}] " + " ".join(words)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """{"ttft", "tokens", "end", "inter_chunk"} of a request served whole, {"retry_after": seconds} of
    one told to retry, {"error": why} otherwise."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    arrivals = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code in (429, 503) and "retry-after" in response.headers:
            return {"retry_after": float(response.headers["retry-after"])}
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                first = first or now
                arrivals.append(now)
    if tokens != max_tokens:
        return {"error": f"{tokens} tokens instead of {max_tokens}"}
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft": (first or time.perf_counter()) - sent, "tokens": tokens, "end": time.perf_counter(),
            "inter_chunk": statistics.median(gaps) if gaps else None}


async def _run(args: argparse.Namespace, model: str) -> dict:
    pending = list(range(args.requests))
    run = uuid.uuid4().hex[:8]
    results: list[dict] = []
    retries = 0
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=_auth(args)) as client:
        async def attempt(index: int) -> dict:
            try:
                return await _one_request(client, args.url, model, _prompt(run, index, args.prompt_tokens),
                                          args.max_tokens)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}

        async def worker() -> None:
            nonlocal retries
            while pending:
                index = pending.pop(0)
                result = await attempt(index)
                while "retry_after" in result and args.flood:
                    retries += 1
                    await asyncio.sleep(result["retry_after"])
                    result = await attempt(index)
                results.append({"error": "told to retry (--flood was not given)"} if "retry_after" in result
                               else result)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        wall = time.perf_counter() - start
    good = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in good]
    gaps = [r["inter_chunk"] for r in good if r["inter_chunk"] is not None]
    tokens = sum(r["tokens"] for r in good)
    return {
        "clients": args.clients, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "model": model, "wall_s": wall, "generated_tokens": tokens,
        "tokens_per_s": tokens / wall, "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": _percentile(ttfts, 99), "inter_chunk_median_s": statistics.median(gaps) if gaps else None,
        "errors": len(results) - len(good), "error_examples": [r["error"] for r in results if "error" in r][:5],
        "served": len(good), "told_to_retry": retries, "lost": len(results) - len(good),
    }


def _auth(args: argparse.Namespace) -> dict[str, str]:
    """The bearer key: the started server's --api-key, else $TESSERA_API_KEY."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--api-key", action="append")
    keys = options.parse_known_args(args.serve_args or [])[0].api_key or [os.environ.get("TESSERA_API_KEY")]
    return {"Authorization": f"Bearer {keys[0]}"} if keys[0] else {}


def _served_url(serve_args: list[str]) -> str:
    """The URL a `tessera serve` started with these arguments answers on."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--host", default="127.0.0.1")
    options.add_argument("--port", default="8000")
    known, _ = options.parse_known_args(serve_args)
    host = "127.0.0.1" if known.host in ("0.0.0.0", "::") else known.host
    return f"http://{host}:{known.port}"


def _wait_for_health(url: str, server: subprocess.Popen | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            sys.exit(f"tessera serve exited with status {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url}/health did not answer within {seconds:.0f} s")


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="the server [http://127.0.0.1:8000, or the started server's --host/--port]")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients [64]")
    parser.add_argument("--requests", type=int, help="requests in all (default: 4 per client)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="about this many prompt tokens [128]")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request [256]")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first, not measured "
                        "(CUDA graph capture, compilation) [1]")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take [600]")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health [600]")
    parser.add_argument("--flood", action="store_true", help="more clients than the server admits: answers that "
                        "say retry are waited out and sent again, and counted (see above)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv[:argv.index("--")] if serve_args is not None else argv)
    args.requests = args.requests or 4 * args.clients
    args.url = args.url or _served_url(serve_args or [])
    args.serve_args = serve_args
    server = None
    if serve_args is not None:
        server = subprocess.Popen([sys.executable, "-m", "tessera", "serve", *serve_args],
                                  cwd=Path(__file__).resolve().parents[1])
    try:
        _wait_for_health(args.url, server, args.startup_timeout)
        model = httpx.get(args.url + "/v1/models", headers=_auth(args)).json()["data"][0]["id"]
        if args.warmup:
            asyncio.run(_run(argparse.Namespace(**{**vars(args), "clients": args.warmup, "requests": args.warmup}),
                             model))
        with GpuSampler() as gpu:   # the server's GPU, if it is this machine's first
            result = asyncio.run(_run(args, model))
        result["gpu"] = gpu.summary()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    print(f"{result['clients']} clients, {result['requests']} requests of {args.prompt_tokens} + {args.max_tokens} "
          f"tokens: {result['tokens_per_s']:,.0f} tokens/s, time to first token median "
          f"{(result['ttft_median_s'] or 0) * 1e3:,.0f} ms, p99 {(result['ttft_p99_s'] or 0) * 1e3:,.0f} ms, "
          f"{result['errors']} errors")
    if args.flood:
        print(f"flood: {result['served']} served, {result['told_to_retry']} told to retry, {result['lost']} lost; "
              f"time to first token of the served p50 {(result['ttft_median_s'] or 0) * 1e3:,.0f} ms, "
              f"p99 {(result['ttft_p99_s'] or 0) * 1e3:,.0f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
