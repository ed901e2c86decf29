"""Inference configuration: the flags of `tessera generate` and `tessera serve`.

    InferenceConfig  the model, its tokenizer and the engine (both commands)
    GenerateConfig   prompts, output and sampling (`tessera generate`)
    ServeConfig      HTTP, keys, admission, limits and drain (`tessera serve`)

Megatron-LM's names where it has them (`--load`, `--tokenizer-type`, `--inference-max-requests`,
`--inference-max-seq-length`, `--inference-dynamic-batching-prefix-caching`, `--seed`,
`--tensor-model-parallel-size`; megatron/training/arguments.py, _add_inference_args), vLLM's
for the server's (`--served-model-name`, `--api-key`; vllm/entrypoints/openai/cli_args.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tessera.config.data import DataConfig
from tessera.config.fields import flag, option, require

DTYPES = ("auto", "float32", "bfloat16", "float16")
API_KEY_VARIABLE = "TESSERA_API_KEY"   # as vLLM's VLLM_API_KEY
TOKENIZER = "tokenizer (default: the tokenizer files of --hf or --load, else the copy a tessera checkpoint carries)"
PARALLEL = "parallel (under torchrun)"
OUTPUT = "prompts and output"
LIMITS = "admission and limits"


def at_least(obj, low: float, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value >= low, f"{flag(name)} must be >= {low}, got {value}")


@dataclass
class InferenceConfig:
    """The model, its tokenizer and the inference engine."""

    load: str | None = option(None, "a tessera checkpoint directory (its newest checkpoint)", metavar="CKPT_DIR")
    hf: str | None = option(None, "a local Hugging Face model directory", metavar="HF_DIR")
    dtype: str = option("auto", "weights' dtype; auto: bfloat16 on a GPU, float32 on the CPU", DTYPES)
    device: str | None = option(None, "torch device (default: cuda if there is one, else cpu)")
    tokenizer_type: str | None = option(None, f"as for `tessera train`: {', '.join(DataConfig.TOKENIZER_TYPES)}",
                                        DataConfig.TOKENIZER_TYPES, group=TOKENIZER, metavar="TYPE")
    tokenizer_model: str | None = option(None, "tokenizer file or directory (tokenizer.json, .model, ...)",
                                         group=TOKENIZER)
    vocab_file: str | None = option(None, "GPT-2 vocab.json (GPT2BPETokenizer)", group=TOKENIZER)
    merge_file: str | None = option(None, "GPT-2 merges.txt (GPT2BPETokenizer)", group=TOKENIZER)
    chat_template: str | None = option(None, "Jinja chat template replacing the tokenizer's", group=TOKENIZER,
                                       metavar="FILE")
    inference_max_requests: int = option(64, "requests decoded together; more wait in the queue")
    inference_max_seq_length: int | None = option(
        None, "longest prompt + output (default: the model's context); bounds the KV cache")
    inference_decode_steps: int = option(
        16, "greedy decode steps run back to back on the GPU between two looks of the host (streamed tokens "
        "then come up to N at a time; 1: every step)", metavar="N")
    inference_dynamic_batching_prefix_caching: bool = option(
        False, "reuse the KV blocks of prompts that start alike (on a GPU the rest of such a prompt runs eagerly: "
        "worth it for long shared prefixes only)")
    inference_dynamic_batching_prefix_caching_mamba_gb: float | None = option(
        None, "with prefix caching on a model with Mamba-2 or Gated DeltaNet layers: GiB of the states saved at "
        "block ends for later prompts to resume from (default: one state per --inference-max-requests)",
        metavar="GB")
    seed: int = option(1234, "seed of requests that bring none")
    tensor_model_parallel_size: int = option(
        1, "split each layer over N ranks: launch with torchrun --nproc-per-node N", group=PARALLEL, metavar="N")
    distributed_timeout_minutes: float = option(10.0, "how long a model collective may wait for another rank",
                                                group=PARALLEL)

    def __post_init__(self) -> None:
        require(self.load is not None or self.hf is not None, "give the model: --load CKPT_DIR or --hf HF_DIR")
        require(self.load is None or self.hf is None, "--load and --hf are exclusive: give one")
        at_least(self, 1, "inference_max_requests", "inference_max_seq_length", "inference_decode_steps",
                 "tensor_model_parallel_size")
        at_least(self, 0, "inference_dynamic_batching_prefix_caching_mamba_gb")

    @property
    def source_flag(self) -> str:
        return "--load" if self.load is not None else "--hf"

    @property
    def source(self) -> str:
        return self.load if self.load is not None else self.hf


@dataclass
class GenerateConfig:
    """Prompts, output and sampling of `tessera generate`."""

    prompt: list[str] | None = option(None, "a prompt (repeat for several)", group=OUTPUT, repeat=True,
                                      metavar="TEXT")
    input: str | None = option(None, "one JSON object a line: its --json-key text, or 'messages' (a chat); other "
                                     "keys are copied to the output", group=OUTPUT, metavar="FILE.jsonl")
    json_key: str = option("prompt", "key holding each line's prompt", group=OUTPUT)
    chat: bool = option(False, "send each prompt as a user message through the chat template", group=OUTPUT)
    output: str | None = option(None, "where to write (default: standard output)", group=OUTPUT, metavar="FILE")
    output_format: str = option("text", "text, or JSONL with token ids, tokens and log-probs", ("text", "jsonl"),
                                group=OUTPUT)
    top_logprobs: int = option(0, "JSONL: also the n most likely tokens", group=OUTPUT)
    max_new_tokens: int = option(64, "tokens to generate per prompt")
    temperature: float = option(1.0, "0 = greedy")
    top_k: int = option(0, "0 = off")
    top_p: float = option(1.0, "in (0, 1]; 1 = off")
    min_p: float = option(0.0, "0 = off")
    repetition_penalty: float = option(1.0, "1 = off")
    stop: list[str] | None = option(None, "stop string (repeatable)", repeat=True, metavar="TEXT")
    ignore_eos: bool = option(False, "do not stop at end-of-sequence tokens")

    def __post_init__(self) -> None:
        require(self.prompt is not None or self.input is not None, "give --prompt TEXT or --input FILE.jsonl")
        require(self.prompt is None or self.input is None, "--prompt and --input are exclusive: give one")
        at_least(self, 1, "max_new_tokens")
        at_least(self, 0, "top_logprobs")


@dataclass
class ServeConfig:
    """HTTP, keys, admission, limits and drain of `tessera serve`."""

    host: str = option("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "port to listen on")
    served_model_name: str | None = option(None, "the model's name in the API (default: the directory's name)")
    log_level: str = option("info", "uvicorn's log level", ("critical", "error", "warning", "info", "debug"))
    api_key: list[str] | None = option(
        None, f"clients must send 'Authorization: Bearer KEY' on every route but /health (repeatable: any of the "
        f"keys; default: ${API_KEY_VARIABLE})", repeat=True, metavar="KEY", secret=True)
    max_queued_requests: int = option(
        256, "requests that may wait beyond --inference-max-requests; past both, 429 with Retry-After",
        group=LIMITS, metavar="N")
    max_request_bytes: int = option(4 * 2**20, "largest request body; past it, 413", group=LIMITS, metavar="BYTES")
    request_timeout: float | None = option(
        None, "seconds a request may take, queueing included; past them it is cut (408) and its KV blocks freed "
        "(default: no limit)", group=LIMITS, metavar="SECONDS")
    drain_timeout: float = option(
        30.0, "on SIGTERM: seconds in-flight requests may take to finish while new ones get 503, before the "
        "rest are cut and the server exits", group=LIMITS, metavar="SECONDS")

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is None:
            self.api_key = [os.environ[API_KEY_VARIABLE]] if os.environ.get(API_KEY_VARIABLE) else []
        require(all(key.strip() for key in self.api_key), f"--api-key (or ${API_KEY_VARIABLE}) must not be empty")
        at_least(self, 0, "max_queued_requests", "drain_timeout")
        at_least(self, 1, "max_request_bytes")
        require(self.request_timeout is None or self.request_timeout > 0,
                f"--request-timeout must be positive, got {self.request_timeout}")


# The sections each command parses (tessera.cli.args.parse_sections), by section name.
GENERATE_SECTIONS = {"inference": InferenceConfig, "generate": GenerateConfig}
SERVE_SECTIONS = {"inference": InferenceConfig, "serve": ServeConfig}
