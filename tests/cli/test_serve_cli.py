"""`tessera serve`: its flags reach the app, and the app it builds answers over HTTP.

uvicorn.run (which blocks and takes the main thread's signals) is replaced by a server
thread on a free port; everything else is the command's own path.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tessera.cli import run
from tests.inference.tiny_text_model import hf_dir, running_server, tokenizer  # noqa: F401 -- fixtures
from tests.ports import free_port


def test_serve_answers_chat_under_its_name_with_its_bounds(hf_dir, tokenizer, monkeypatch, capsys):
    from tessera.inference.drain import DrainingServer

    answers = {}

    def serve_in_a_thread(server):
        answers["listen"] = (server.config.host, server.config.port, server.config.log_level)
        with running_server(server.config.app) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            answers["models"] = client.models.list().data
            answers["chat"] = client.chat.completions.create(
                model="my-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
            with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
                client.completions.create(model="my-model", prompt="x", max_tokens=100)

    monkeypatch.setattr(DrainingServer, "run", serve_in_a_thread)
    monkeypatch.delenv("TESSERA_API_KEY", raising=False)
    assert run(["serve", "--hf", str(hf_dir), "--host", "0.0.0.0", "--port", "8123", "--served-model-name",
                "my-model", "--inference-max-seq-length", "64", "--inference-max-requests", "2"]) == 0
    assert answers["listen"] == ("0.0.0.0", 8123, "info")
    assert [m.id for m in answers["models"]] == ["my-model"]
    chat = answers["chat"]
    assert chat.model == "my-model" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--host 0.0.0.0" in warnings[0] and "no --api-key" in warnings[0]


def test_keys_from_flags_and_the_environment_guard_every_route_but_health(hf_dir, monkeypatch, capsys):
    from tessera.inference.drain import DrainingServer

    statuses = {}

    def serve_in_a_thread(server):
        with running_server(server.config.app) as base:
            for key in ("flag-key", "env-key", "wrong", None):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                statuses[key] = [httpx.get(base + path, headers=headers).status_code for path in ("/v1/models",
                                                                                                 "/health")]

    monkeypatch.setattr(DrainingServer, "run", serve_in_a_thread)
    monkeypatch.setenv("TESSERA_API_KEY", "env-key")
    assert run(["serve", "--hf", str(hf_dir), "--host", "0.0.0.0", "--api-key", "flag-key"]) == 0
    assert statuses == {"flag-key": [200, 200], "env-key": [401, 200], "wrong": [401, 200], None: [401, 200]}
    monkeypatch.setattr(DrainingServer, "run", serve_in_a_thread)
    assert run(["serve", "--hf", str(hf_dir), "--host", "0.0.0.0"]) == 0   # the environment's key alone
    assert statuses["env-key"] == [200, 200] and statuses["flag-key"] == [401, 200]
    err = capsys.readouterr().err
    assert "warning" not in err and "flag-key" not in err and "env-key" not in err


def test_a_key_stays_out_of_the_configuration_repr():
    from tessera.config.inference import ServeConfig

    config = ServeConfig(api_key=["s3cret-key"])
    assert config.api_key == ["s3cret-key"] and "s3cret-key" not in repr(config)


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0"),
    (["--request-timeout", "0"], "--request-timeout must be positive"),
    (["--api-key", " "], "--api-key (or $TESSERA_API_KEY) must not be empty"),
    (["--inference-max-requests", "0"], "--inference-max-requests must be >= 1"),
    (["--inference-decode-steps", "0"], "--inference-decode-steps must be >= 1"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja"),
])
def test_bad_flags_stop_with_one_line_naming_them(hf_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(["serve", "--hf", str(hf_dir), *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_missing_model_directory_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(["serve", "--hf", str(tmp_path / "absent")])
    assert f"--hf {tmp_path / 'absent'}: no such directory" in capsys.readouterr().err


def test_graphs_captured_while_serving_are_reported_at_exit(capsys):
    """Each capture stalls every request: the exit line says how many the warm-up missed, and nothing when none."""
    from types import SimpleNamespace

    from tessera.cli.serve import _report_captures

    captures = [(3, 1.5)]
    engine = SimpleNamespace(runner=SimpleNamespace(graph_captures=lambda: captures[0]))
    _report_captures(engine, (3, 1.5))
    assert capsys.readouterr().err == ""
    captures[0] = (5, 2.25)
    _report_captures(engine, (3, 1.5))
    assert "2 CUDA graphs were captured while serving, the engine stalled 0.8 s" in capsys.readouterr().err


def test_sigterm_during_a_stream_finishes_it_then_exits_0(hf_dir):
    """A real `tessera serve` process, stopped as an orchestrator stops it. Its steps are slowed (20 ms)
    so that the stream is still running when SIGTERM comes; the exit report is the app's shutdown
    hook and runs too. The key, from the environment, is never printed."""
    port, key = free_port(), "secret-key-0123"
    script = ("import sys, time\nimport tessera.cli.serve as serve\nfrom tessera.inference.engine import Engine\n"
              "serve._report_captures = lambda *_: print('REPORTED', file=sys.stderr, flush=True)\n"
              "step = Engine.step\nEngine.step = lambda self: (time.sleep(0.02), step(self))[1]\n"
              f"serve.main(['--hf', {str(hf_dir)!r}, '--port', '{port}', '--inference-decode-steps', '1'])\n")
    server = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TESSERA_API_KEY": key})
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    body = {"prompt": "The quick", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        _wait_for_health(base, server)
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=auth, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and not events:
                    server.send_signal(signal.SIGTERM)
                    while httpx.get(base + "/health").status_code == 200:
                        time.sleep(0.01)
                    refused = httpx.post(base + "/v1/completions", json=body, headers=auth)
                if line.startswith("data: "):
                    events.append(line[6:])
        _, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 100
    assert server.returncode == 0, err
    assert "drained on SIGTERM: 1 of 1 requests in flight finished, 0 cut" in err and "REPORTED" in err
    assert key not in err and "API key required" in err


def _wait_for_health(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"the server did not come up: {server.poll()}")
