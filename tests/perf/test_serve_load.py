"""bench/serve_load.py: a server it starts is waited for where that server listens."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from serve_load import _served_url  # noqa: E402


def test_the_started_server_url_follows_its_host_and_port():
    assert _served_url(["--hf", "model", "--port", "8011"]) == "http://127.0.0.1:8011"
    assert _served_url(["--host", "10.0.0.2", "--port=9000"]) == "http://10.0.0.2:9000"
    assert _served_url(["--host", "0.0.0.0"]) == "http://127.0.0.1:8000"   # every interface: ask locally
    assert _served_url([]) == "http://127.0.0.1:8000"


def test_no_two_prompts_share_a_first_kv_block():
    """Prefix caching names blocks of 16 tokens from the first: prompts of two runs (the warm-up and the
    measured one) and of two requests differ within their first 16 characters."""
    from serve_load import _prompt

    first = {_prompt(run, index, 128)[:16] for run in ("a1b2c3d4", "e5f6a7b8") for index in range(300)}
    assert len(first) == 600


def test_the_serve_model_loads_as_a_model_and_a_chat_tokenizer(tmp_path):
    import subprocess

    from tessera.inference.text import load_tokenizer
    from tessera.interop.hf import load_hf

    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "bench" / "serve_model.py"),
                    str(tmp_path), "--config", "tiny"], check=True, capture_output=True)
    model = load_hf(tmp_path)
    assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (2, 128, 1000)
    tokenizer = load_tokenizer(search_dirs=[tmp_path])
    ids = tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert ids and max(ids) < 1000 and tokenizer.decode(tokenizer.encode("abc def")) == "abc def"
