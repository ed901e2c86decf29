"""A checkpoint carries its tokenizer: a run trained on text tokenized by a tokenizer named by a
relative path saves a copy beside its checkpoints, and `tessera generate --load` runs from another
directory once the original is gone, encoding prompts as training did."""

import json
import os
import shutil

from tessera.cli import run
from tessera.config import DataConfig
from tessera.data.preprocess import preprocess
from tessera.data.tokenizers import build_tokenizer
from tessera.training.checkpoint_files import CONFIG, TOKENIZER_DIR, iteration_dir
from tessera.training.trainer import Trainer
from tests.conftest import TINY, run_config
from tests.interop.tokenizer_files import CORPUS, TEXTS, make_tokenizer

FLAGS = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "tok/bpe.json", "--vocab-size", "512",
         "--data-path", "corpus_text_document", "--split", "100,0,0", "--data-cache-path", "cache", "--save", "ckpt"]


def test_generate_finds_the_tokenizer_in_the_checkpoint_from_anywhere(tmp_path, monkeypatch):
    work = tmp_path / "work"
    make_tokenizer("hf-file", work / "tok")   # tok/bpe.json
    monkeypatch.chdir(work)
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in CORPUS))
    data = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="tok/bpe.json")
    preprocess(["corpus.jsonl"], "corpus", data, append_eod=True)
    base = [flag for flag in TINY if flag != "--mock-data"]   # --mock-data would win over --data-path
    Trainer(run_config(*FLAGS, "--train-iters", "2", base=base)).train()

    copy = work / "ckpt" / TOKENIZER_DIR / "bpe.json"
    assert copy.read_bytes() == (work / "tok" / "bpe.json").read_bytes()
    saved = (iteration_dir(work / "ckpt", 2) / CONFIG).read_text()
    assert f"tokenizer_model: {TOKENIZER_DIR}/bpe.json" in saved   # relative to the checkpoint directory
    before = os.stat(copy)
    Trainer(run_config(*FLAGS, "--train-iters", "3", "--load", "ckpt", base=base)).train()   # resumed: saves again
    after = os.stat(copy)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)   # not copied again

    prompt = TEXTS[0]
    expected = [int(i) for i in build_tokenizer(data).tokenize(prompt)]
    shutil.rmtree(work / "tok")
    monkeypatch.chdir(tmp_path)
    assert run(["generate", "--load", "work/ckpt", "--prompt", prompt, "--max-new-tokens", "2", "--temperature", "0",
                "--output-format", "jsonl", "--output", "out.jsonl"]) == 0
    [record] = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["prompt_tokens"] == len(expected) and len(record["token_ids"]) == 2


def test_a_run_without_a_tokenizer_saves_none(tmp_path):
    Trainer(run_config("--save", str(tmp_path), "--train-iters", "1")).train()
    assert not (tmp_path / TOKENIZER_DIR).exists()
    assert "tokenizer_model: null" in (iteration_dir(tmp_path, 1) / CONFIG).read_text()
