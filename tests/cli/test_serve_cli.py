"""`tessera serve`: its flags reach the app, and the app it builds answers over HTTP.

uvicorn.run (which blocks and takes the main thread's signals) is replaced by a server
thread on a free port; everything else is the command's own path.
"""

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


def test_serve_answers_chat_under_its_name_with_its_bounds(hf_dir, tokenizer, monkeypatch):
    import uvicorn

    answers = {}

    def serve_in_a_thread(app, host, port, log_level):
        answers["listen"] = (host, port, log_level)
        with running_server(app) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
            answers["models"] = client.models.list().data
            answers["chat"] = client.chat.completions.create(
                model="my-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
            with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
                client.completions.create(model="my-model", prompt="x", max_tokens=100)

    monkeypatch.setattr(uvicorn, "run", serve_in_a_thread)
    assert run(["serve", "--hf", str(hf_dir), "--host", "0.0.0.0", "--port", "8123", "--served-model-name",
                "my-model", "--inference-max-seq-length", "64", "--inference-max-requests", "2"]) == 0
    assert answers["listen"] == ("0.0.0.0", 8123, "info")
    assert [m.id for m in answers["models"]] == ["my-model"]
    chat = answers["chat"]
    assert chat.model == "my-model" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tokenizer.encode_chat([{"role": "user", "content": "hi"}]))


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
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


def test_the_exit_report_runs_when_a_signal_stops_the_server(hf_dir):
    """uvicorn raises SIGTERM again once it has drained, so nothing after uvicorn.run runs: the
    report is the app's shutdown hook. A real `tessera serve` process, stopped as a user stops it."""
    port = free_port()
    script = ("import sys\nimport tessera.cli.serve as serve\n"
              "serve._report_captures = lambda *_: print('REPORTED', file=sys.stderr, flush=True)\n"
              f"serve.main(['--hf', {str(hf_dir)!r}, '--port', '{port}', '--log-level', 'warning'])\n")
    server = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert "on http://127.0.0.1" in err and "REPORTED" in err, err
