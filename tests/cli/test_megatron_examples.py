"""Megatron-LM's entry points under examples/megatron, and the library loop of examples/simple_train_loop.py."""

import re
import subprocess
import sys
from pathlib import Path

from tessera.cli.args import parse_run_config
from tessera.cli.megatron_flags import ignored_note
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


# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, every flag as the script passes it (with
# --mock-data), the model and its schedule shrunk.
MEGATRON_LLAMA3_FP8_ARGS = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
    "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "80", "--lr-decay-samples", "76",
    "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--tiktoken-pattern", "v2",
    "--split", "99,1,0", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
    "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60", "--save", "ckpt", "--load", "ckpt",
    "--tensorboard-dir", "tb",
]


def test_megatron_s_llama3_fp8_script_flags_are_all_taken():
    config, namespace = parse_run_config(MEGATRON_LLAMA3_FP8_ARGS, world_size=1)
    assert config.train.train_iters == 10 and config.optim.decoupled_lr == 5.0e-4
    assert config.train.fp8_format == "hybrid" and config.train.attention_backend == "cudnn"
    assert not config.parallel.sequence_parallel and config.notes   # off at TP=1, with a note, as in Megatron
    assert "--apply-layernorm-1p" in ignored_note(namespace)
