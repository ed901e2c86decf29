"""`tessera generate`: sample text from a tessera checkpoint or a Hugging Face directory.

    tessera generate --hf HF_DIR --prompt "Once upon a time" --max-new-tokens 64 --temperature 0
    tessera generate --load CKPT_DIR --input prompts.jsonl --output out.jsonl --output-format jsonl

The model and tokenizer flags (`add_model_arguments`, `build_engine`) are shared with `tessera serve`.
Under `torchrun --nproc-per-node N ... --tensor-model-parallel-size N` every rank runs the same
prompts on its shard of the model (tessera.inference.lockstep) and rank 0 writes the output.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

from tessera.cli.args import _Parser, fail
from tessera.config import ConfigError, DataConfig
from tessera.files import atomic_write

PROG = "tessera generate"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--load/--hf, the tokenizer flags and the engine's bounds (Megatron's names where it has them)."""
    model = parser.add_argument_group("model")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", metavar="CKPT_DIR", help="a tessera checkpoint directory (its newest checkpoint)")
    source.add_argument("--hf", metavar="HF_DIR", help="a local Hugging Face model directory")
    model.add_argument("--dtype", choices=DTYPES, default="auto", help="weights' dtype; auto: bfloat16 on a GPU, "
                       "float32 on the CPU")
    model.add_argument("--device", help="torch device (default: cuda if there is one, else cpu)")
    tokenizer = parser.add_argument_group("tokenizer (default: the tokenizer files of --hf or --load, else the "
                                          "copy of its tokenizer a tessera checkpoint carries)")
    tokenizer.add_argument("--tokenizer-type", choices=DataConfig.TOKENIZER_TYPES, metavar="TYPE",
                           help=f"as for `tessera train`: {', '.join(DataConfig.TOKENIZER_TYPES)}")
    tokenizer.add_argument("--tokenizer-model", help="tokenizer file or directory (tokenizer.json, .model, ...)")
    tokenizer.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    tokenizer.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    tokenizer.add_argument("--chat-template", metavar="FILE", help="Jinja chat template replacing the tokenizer's")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--inference-max-requests", type=int, default=64,
                        help="requests decoded together; more wait in the queue")
    engine.add_argument("--inference-max-seq-length", type=int,
                        help="longest prompt + output (default: the model's context); bounds the KV cache")
    engine.add_argument("--inference-decode-steps", type=int, default=16, metavar="N",
                        help="greedy decode steps run back to back on the GPU between two looks of the host "
                             "(streamed tokens then come up to N at a time; 1: every step) [16]")
    engine.add_argument("--inference-dynamic-batching-prefix-caching", action="store_true",
                        help="reuse the KV blocks of prompts that start alike (on a GPU the rest of such a "
                             "prompt runs eagerly: worth it for long shared prefixes only)")
    engine.add_argument("--seed", type=int, default=1234, help="seed of requests that bring none")
    parallel = parser.add_argument_group("parallel (under torchrun)")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                          help="split each layer over N ranks: launch with torchrun --nproc-per-node N [1]")
    parallel.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                          help="how long a model collective may wait for another rank [10]")


def _dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def build_engine(args: argparse.Namespace, prog: str):
    """(Engine, TextTokenizer, model name, TensorParallel or None) from the parsed model flags; exits with
    one line on a bad one. Under tensor parallelism the engine holds this rank's shard."""
    import torch

    from tessera.inference.engine import Engine
    from tessera.inference.loading import load_model
    from tessera.inference.lockstep import init_tensor_parallel
    from tessera.inference.text import load_tokenizer, read_chat_template

    for name in ("inference_max_requests", "inference_max_seq_length", "inference_decode_steps",
                 "tensor_model_parallel_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(prog, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    source = args.load or args.hf
    try:
        if not Path(source).is_dir():
            raise ConfigError(f"{'--load' if args.load else '--hf'} {source}: no such directory")
        chat_template = read_chat_template(args.chat_template)
        parallel = init_tensor_parallel(args.tensor_model_parallel_size, device, args.distributed_timeout_minutes)
        device = parallel.device if parallel else device
        model, info = load_model(load=args.load, hf=args.hf, dtype=_dtype(args.dtype, device), device=device,
                                 tp_group=parallel.model_group if parallel else None)
        tokenizer = load_tokenizer(
            tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
            merge_file=args.merge_file, chat_template=chat_template, search_dirs=[info.tokenizer_dir],
            checkpoint_config=info.checkpoint_config)
        eos = tuple(dict.fromkeys((*info.eos_token_ids, *tokenizer.eos_token_ids)))

        def make_engine(num_blocks: int | None = None) -> Engine:
            return Engine(model, max_requests=args.inference_max_requests, num_blocks=num_blocks,
                          max_seq_length=args.inference_max_seq_length, eos_token_ids=eos, seed=args.seed,
                          decode_steps=args.inference_decode_steps,
                          prefix_caching=args.inference_dynamic_batching_prefix_caching)

        engine = parallel.agree_on_cache(make_engine) if parallel else make_engine()
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        fail(prog, str(exc))
    return engine, tokenizer, Path(source).resolve().name, parallel


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, description="Generate text from a tessera checkpoint or a "
                     "Hugging Face directory, on one prompt or a JSONL file of them.")
    prompts = parser.add_argument_group("prompts and output")
    given = prompts.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for several)")
    given.add_argument("--input", metavar="FILE.jsonl", help="one JSON object a line: its --json-key text, or "
                       "'messages' (a chat); other keys are copied to the output")
    prompts.add_argument("--json-key", default="prompt", help="key holding each line's prompt [prompt]")
    prompts.add_argument("--chat", action="store_true", help="send each prompt as a user message through the "
                         "chat template")
    prompts.add_argument("--output", metavar="FILE", help="where to write (default: standard output)")
    prompts.add_argument("--output-format", choices=("text", "jsonl"), default="text",
                         help="text, or JSONL with token ids, tokens and log-probs [text]")
    prompts.add_argument("--top-logprobs", type=int, default=0, help="JSONL: also the n most likely tokens [0]")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt [64]")
    sampling.add_argument("--temperature", type=float, default=1.0, help="0 = greedy [1.0]")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off [0]")
    sampling.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off [1.0]")
    sampling.add_argument("--min-p", type=float, default=0.0, help="0 = off [0.0]")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off [1.0]")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    add_model_arguments(parser)
    return parser


def _read_records(args: argparse.Namespace) -> list[dict]:
    if args.prompt is not None:
        return [{args.json_key: text} for text in args.prompt]
    records = []
    try:
        lines = Path(args.input).read_text().splitlines()
    except OSError as exc:
        fail(PROG, f"--input {args.input}: {exc.strerror}")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            fail(PROG, f"{args.input}:{number}: not valid JSON ({exc})")
        if not isinstance(record, dict) or not (isinstance(record.get(args.json_key), str)
                                                or isinstance(record.get("messages"), list)):
            fail(PROG, f"{args.input}:{number}: needs a string '{args.json_key}' (see --json-key) or a list "
                       "'messages'")
        records.append(record)
    if not records:
        fail(PROG, f"--input {args.input}: no prompts in it")
    return records


def _encode(tokenizer, record: dict, args: argparse.Namespace) -> list[int]:
    from tessera.inference.text import ChatTemplateError

    try:
        if "messages" in record and args.json_key not in record:
            return tokenizer.encode_chat(record["messages"])
        if args.chat:
            return tokenizer.encode_chat([{"role": "user", "content": record[args.json_key]}])
    except ChatTemplateError as exc:
        fail(PROG, str(exc))
    return tokenizer.encode(record[args.json_key])


def _write(out, record: dict, text, tokenizer, args: argparse.Namespace) -> None:
    if args.output_format == "text":
        shown_prompt = "" if args.chat or args.json_key not in record else record[args.json_key]
        out.write(shown_prompt + text.text + "\n\n")
        return
    answer = {**record, "completion": text.text, "finish_reason": text.finish_reason,
              "prompt_tokens": len(text.prompt_ids), "token_ids": text.token_ids,
              "tokens": [tokenizer.token_text(t) for t in text.token_ids], "logprobs": text.logprobs}
    if args.top_logprobs:
        answer["top_logprobs"] = [{tokenizer.token_text(t): v for t, v in top.items()} for top in text.top_logprobs]
    out.write(json.dumps(answer, ensure_ascii=False) + "\n")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.max_new_tokens < 1:
        fail(PROG, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    records = _read_records(args)
    from tqdm import tqdm

    from tessera.inference.sampling import SamplingParams
    from tessera.inference.text import generate_texts

    engine, tokenizer, _, parallel = build_engine(args, PROG)
    writes = parallel is None or parallel.rank == 0   # the other ranks only keep rank 0's engine in step
    prompts = [_encode(tokenizer, record, args) for record in records]
    params = []
    for number, prompt in enumerate(prompts, 1):
        room = engine.max_seq_length - len(prompt)
        if room < 1 or not prompt:
            fail(PROG, f"prompt {number}: {len(prompt)} tokens, the context holds {engine.max_seq_length} "
                       "(--inference-max-seq-length) and one new token at least")
        params.append(SamplingParams(
            max_tokens=min(args.max_new_tokens, room), temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty, ignore_eos=args.ignore_eos,
            logprobs=args.top_logprobs if args.output_format == "jsonl" else None))
    try:
        params[0].validate()
    except ValueError as exc:
        fail(PROG, f"--{str(exc).replace('_', '-')}")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        fail(PROG, f"--output {args.output}: its directory does not exist")
    progress = tqdm(total=len(prompts), unit="prompt", disable=args.input is None or not writes, file=sys.stderr)
    start = time.perf_counter()
    try:
        texts = generate_texts(engine, tokenizer, prompts, params, stop=args.stop,
                               on_finished=lambda index, text: progress.update())
    finally:
        progress.close()
    elapsed = time.perf_counter() - start
    if parallel:
        parallel.leave()
    if not writes:   # the other ranks only kept rank 0's engine in step
        return 0
    out = io.StringIO()
    for record, text in zip(records, texts):
        _write(out, record, text, tokenizer, args)
    if args.output:   # a temporary name, then renamed: never a half-written file
        atomic_write(args.output, lambda file: file.write(out.getvalue().encode()))
    else:
        sys.stdout.write(out.getvalue())
    generated = sum(text.completion_tokens for text in texts)
    print(f"{PROG}: {len(prompts)} prompt{'s' * (len(prompts) > 1)}, {sum(map(len, prompts))} prompt tokens, "
          f"{generated} generated in {elapsed:.2f} s: {generated / elapsed:,.1f} tokens/s", file=sys.stderr)
    return 0
