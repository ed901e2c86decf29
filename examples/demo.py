"""`make demo`: the whole pipeline on real text that exists offline on every machine.

1. corpus      the Python standard library's source files, as JSONL documents
2. tokenizer   `tessera train-tokenizer`: byte-level BPE (Hugging Face tokenizers)
3. preprocess  `tessera preprocess`: Megatron .bin/.idx, with end-of-document tokens
4. train       `tessera train`: a small LLaMA-style model for about a minute, on the GPU if
               there is one; the validation loss is printed as it falls
5. sample      greedy continuation of a few Python prompts

Everything goes under runs/demo/ (created once, reused by later runs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.data.corpus import build_stdlib_corpus  # noqa: E402
from tessera.data.tokenizers import HuggingFaceTokenizer  # noqa: E402
from tessera.inference.generate import generate  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

WORK = ROOT / "runs" / "demo"
VOCAB = 4096


def tessera(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tessera", *args], check=True, cwd=ROOT)


def prepare(work: Path = WORK, vocab: int = VOCAB, max_mb: float = 8, more_roots: tuple[Path, ...] = ()
            ) -> tuple[Path, Path]:
    """Steps 1-3 under `work` (each skipped when its output exists): the dataset's prefix and the tokenizer.
    `more_roots`: directories whose Python sources join the standard library's."""
    work.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer = work / "stdlib.jsonl", work / "tokenizer.json"
    prefix = work / "stdlib"
    if not corpus.exists():
        documents, size = build_stdlib_corpus(corpus, max_mb=max_mb, more_roots=more_roots)
        print(f"[1/5] corpus: {documents} Python files from the standard library"
              f"{' and ' + ', '.join(map(str, more_roots)) if more_roots else ''}, {size / 1e6:.1f} MB")
    if not tokenizer.exists():
        print("[2/5] training a BPE tokenizer")
        tessera("train-tokenizer", "--input", str(corpus), "--output", str(tokenizer), "--vocab-size", str(vocab))
    data = Path(f"{prefix}_text_document")
    if not data.with_suffix(".idx").exists():
        print("[3/5] preprocessing into Megatron .bin/.idx")
        tessera("preprocess", "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--append-eod", "--workers", "2")
    return data, tokenizer


def main() -> None:
    data, tokenizer_path = prepare()
    on_gpu = torch.cuda.is_available()
    flags = [
        "--num-layers", "4", "--hidden-size", "256" if on_gpu else "192", "--num-attention-heads", "4",
        "--seq-length", "128", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--make-vocab-size-divisible-by", "64",
        "--data-path", str(data), "--split", "98,2,0", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tokenizer_path), "--data-cache-path", str(WORK / "cache"),
        "--micro-batch-size", "16", "--global-batch-size", "32", "--train-iters", "2000" if on_gpu else "160",
        "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20",
        "--log-interval", "20", "--eval-interval", "40", "--eval-iters", "4", "--num-workers", "1",
        *(["--bf16"] if on_gpu else []),
    ]
    config, _ = parse_run_config(flags + sys.argv[1:], "examples/demo.py")
    print(f"[4/5] training on {'cuda' if on_gpu else 'cpu'}: watch the validation loss fall\n")
    trainer = Trainer(config)
    trainer.train()

    print("\n[5/5] samples (greedy):")
    tokenizer = HuggingFaceTokenizer(str(tokenizer_path))
    for prompt in ["def __init__(self", "import os\nimport ", "    for i in range("]:
        ids = torch.tensor([tokenizer.tokenize(prompt)], device=trainer.device)
        out = generate(trainer.model, ids, max_new_tokens=24, temperature=0, vocab_size=tokenizer.vocab_size)
        text = tokenizer.detokenize(out[0, ids.shape[1]:].tolist())
        print(f"  {prompt!r} -> {text!r}")


if __name__ == "__main__":
    main()
