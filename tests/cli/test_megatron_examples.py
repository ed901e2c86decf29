"""Megatron-LM's entry points under examples/megatron, and the library loop of examples/simple_train_loop.py."""

import re
import subprocess
import sys
from pathlib import Path

from tests.dist.test_torchrun import TORCHRUN

EXAMPLES = Path(__file__).parents[2] / "examples"

# The argument groups of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, flag for flag, at
# a size a CPU trains in seconds (and --mock-data for its dataset; its --step-batch-size-schedule, a
# batch-size ramp tessera does not have, left out).
MEGATRON_GPT3_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0",
    "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "3",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--mock-data", "--vocab-size", "128", "--split", "949,50,1",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
    # What other Megatron scripts add: Transformer Engine and Megatron-Core switches, shorthands.
    "--transformer-impl", "transformer_engine", "--use-mcore-models", "--use-flash-attn",
    "--recompute-activations", "--no-masked-softmax-fusion", "--num-workers", "0",
]


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_pretrain_gpt_runs_a_megatron_script_s_flags(tmp_path):
    result = run(sys.executable, "pretrain_gpt.py", *MEGATRON_GPT3_ARGS, "--save", str(tmp_path / "ckpt"),
                 "--load", str(tmp_path / "ckpt"), cwd=EXAMPLES / "megatron")
    assert "iteration        3/       3" in result.stdout
    assert "note: Megatron-LM flags with no effect here: --transformer-impl" in result.stdout
    assert result.stderr.count("error") == 0


def test_preprocess_data_writes_what_tessera_preprocess_writes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello world"}\n{"text": "a second document"}\n')
    flags = ["--input", str(corpus), "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"]
    run(sys.executable, "tools/preprocess_data.py", *flags, "--output-prefix", str(tmp_path / "megatron"),
        cwd=EXAMPLES / "megatron")
    run(sys.executable, "-m", "tessera", "preprocess", *flags, "--output-prefix", str(tmp_path / "tessera"),
        cwd=tmp_path)
    for suffix in ("bin", "idx"):
        written = (tmp_path / f"megatron_text_document.{suffix}").read_bytes()
        assert written and written == (tmp_path / f"tessera_text_document.{suffix}").read_bytes()


def test_simple_train_loop_takes_the_world_size_from_torchrun(tmp_path):
    """Under torchrun it takes the world size from the environment and trains TP=2 with one
    process's losses."""
    def losses(result):
        return re.findall(r"loss (\S+)", result.stdout)

    one = run(sys.executable, str(EXAMPLES / "simple_train_loop.py"), cwd=tmp_path)
    two = run(*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "simple_train_loop.py"),
              cwd=tmp_path)
    assert len(losses(one)) == 4 and losses(two) == losses(one)
