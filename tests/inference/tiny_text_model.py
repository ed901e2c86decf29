"""A tiny Llama with a real tokenizer and chat template, built offline, for the text/HTTP/CLI tests.

The tokenizer is a byte-level BPE trained here (Hugging Face `tokenizers`), saved with a
chat template through `transformers` as an HF directory; the model is a random
`transformers` Llama saved next to it, so the same directory is an `--hf` model.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

from tessera.data.train_tokenizer import EOD_TOKEN, TrainingText, train_bpe_tokenizer
from tests.ports import free_port

VOCAB = 320
CONTEXT = 256
# Roles in angle brackets, the assistant's turn left open: easy to check by eye.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "héllo wörld, ünïcode façade — naïve café",
          "def main():\n    return 42\n", "你好，世界。こんにちは", "tessera trains transformer language models"]


def build_hf_dir(path: Path) -> Path:
    """An HF model directory: config.json + safetensors, tokenizer.json + chat template."""
    path.mkdir(parents=True, exist_ok=True)
    corpus = path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS * 20))
    train_bpe_tokenizer(TrainingText([str(corpus)]), str(path / "bpe.json"), vocab_size=VOCAB, min_frequency=1)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "bpe.json"), eos_token=EOD_TOKEN,
                                                     bos_token=EOD_TOKEN, chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(path)
    (path / "bpe.json").unlink()
    corpus.unlink()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    return build_hf_dir(tmp_path_factory.mktemp("tiny-hf"))


@pytest.fixture(scope="session")
def tokenizer(hf_dir):
    from tessera.inference.text import load_tokenizer

    return load_tokenizer(search_dirs=[hf_dir])


def tiny_engine(hf_dir: Path, tokenizer, **kwargs):
    """The real engine over the tiny HF model, fp32 on the CPU."""
    from tessera.inference.engine import Engine
    from tessera.inference.loading import load_model

    model, info = load_model(hf=str(hf_dir), dtype=torch.float32, device="cpu")
    kwargs.setdefault("max_requests", 4)
    return Engine(model, max_seq_length=CONTEXT, eos_token_ids=tokenizer.eos_token_ids, **kwargs)


@contextlib.contextmanager
def running_server(app, host: str = "127.0.0.1"):
    """Serve `app` with uvicorn on a free port in a background thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join()
