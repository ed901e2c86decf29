"""`tessera serve`: an OpenAI-compatible HTTP server (and Megatron's `PUT /api`) over one model.

    tessera serve --hf HF_DIR --port 8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Routes and their schemas: tessera.inference.server and docs/inference.md. Under
`torchrun --nproc-per-node N ... --tensor-model-parallel-size N` rank 0 serves HTTP and the
other ranks step their shards in lockstep with it (tessera.inference.lockstep).
"""

from __future__ import annotations

import functools
import sys

from tessera.cli.args import fail, parse_sections
from tessera.config import ConfigError
from tessera.config.inference import SERVE_SECTIONS

PROG = "tessera serve"
DESCRIPTION = ("Serve a tessera checkpoint or a Hugging Face directory over HTTP: OpenAI's /v1/completions and "
               "/v1/chat/completions (streaming too), /v1/models, /health, and Megatron-LM's PUT /api.")


def main(argv: list[str]) -> int:
    sections = parse_sections(argv, PROG, DESCRIPTION, SERVE_SECTIONS)
    try:   # the serving stack is an extra: say so before the model loads
        import uvicorn  # noqa: F401

        import tessera.inference.server  # noqa: F401
    except ImportError as exc:
        fail(PROG, f"{exc.name} is missing: pip install 'tessera[serve]'")
    from tessera.inference.builder import build_engine

    try:
        built = build_engine(sections["inference"])
    except ConfigError as exc:
        fail(PROG, str(exc))
    engine, tokenizer, name, parallel = built.engine, built.tokenizer, built.model_name, built.parallel
    seconds = engine.warm_up()   # every rank alike (under TP they step in lockstep)
    if parallel is None or parallel.rank == 0:
        print(f"{PROG}: warmed up in {seconds:.1f} s (compiling the decode step, capturing CUDA graphs)",
              file=sys.stderr)
    warmed_up = engine.runner.graph_captures()
    report = functools.partial(_report_captures, engine, warmed_up)
    if parallel is None:
        _serve(engine, tokenizer, name, sections, report)
        return 0
    from tessera.inference.lockstep import Leader, follow

    if parallel.rank != 0:
        follow(engine, parallel)
        parallel.leave()
        return 0
    leader = Leader(engine, parallel)
    with leader.serving():
        _serve(leader, tokenizer, name, sections, report)
    if leader.failed:   # the other ranks may be stuck in a collective: exiting non-zero has torchrun end them
        fail(PROG, "the engine failed; see the log above")
    parallel.leave()
    return 0


def _report_captures(engine, warmed_up: tuple[int, float]) -> None:
    """Say at exit how many CUDA graphs were captured while serving: each stalled every request."""
    count, seconds = engine.runner.graph_captures()
    if count > warmed_up[0]:
        print(f"{PROG}: {count - warmed_up[0]} CUDA graphs were captured while serving, the engine stalled "
              f"{seconds - warmed_up[1]:.1f} s for them (batch shapes the warm-up did not meet)", file=sys.stderr)


def _serve(engine, tokenizer, name: str, sections: dict, on_shutdown) -> None:
    import uvicorn

    from tessera.inference.auth import is_loopback
    from tessera.inference.drain import DrainingServer
    from tessera.inference.server import create_app

    args = sections["serve"]
    app = create_app(engine, tokenizer, model_name=args.served_model_name or name, serving=args,
                     on_shutdown=on_shutdown)
    print(f"{PROG}: '{app.state.server.model_name}' on http://{args.host}:{args.port}/v1 "
          f"(context {engine.max_seq_length}, {sections['inference'].inference_max_requests} requests at a time, "
          f"{args.max_queued_requests} more queued{', API key required' if args.api_key else ''})", file=sys.stderr)
    if not args.api_key and not is_loopback(args.host):
        print(f"{PROG}: warning: --host {args.host} takes connections from other machines and no --api-key is set: "
              "anyone who reaches the port can use the model", file=sys.stderr)

    async def drain() -> None:
        finished, cut = await app.state.server.drain(args.drain_timeout)
        print(f"{PROG}: drained on SIGTERM: {finished} of {finished + cut} requests in flight finished, {cut} cut "
              f"at --drain-timeout ({args.drain_timeout:g} s)", file=sys.stderr, flush=True)

    DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level), drain).run()
