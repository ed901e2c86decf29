"""`tessera generate`: sample text from a tessera checkpoint or a Hugging Face directory.

    tessera generate --hf HF_DIR --prompt "Once upon a time" --max-new-tokens 64 --temperature 0
    tessera generate --load CKPT_DIR --input prompts.jsonl --output out.jsonl --output-format jsonl

The flags are tessera.config.inference's InferenceConfig (model, tokenizer, engine; shared with
`tessera serve`) and GenerateConfig (prompts, output, sampling).
Under `torchrun --nproc-per-node N ... --tensor-model-parallel-size N` every rank runs the same
prompts on its shard of the model (tessera.inference.lockstep) and rank 0 writes the output.
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from tessera.cli.args import fail, parse_sections
from tessera.config import ConfigError
from tessera.config.inference import GENERATE_SECTIONS, GenerateConfig
from tessera.files import atomic_write

PROG = "tessera generate"
DESCRIPTION = ("Generate text from a tessera checkpoint or a Hugging Face directory, on one prompt or a JSONL "
               "file of them.")


def _read_records(args: GenerateConfig) -> list[dict]:
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


def _encode(tokenizer, record: dict, args: GenerateConfig) -> list[int]:
    from tessera.inference.text import ChatTemplateError

    try:
        if "messages" in record and args.json_key not in record:
            return tokenizer.encode_chat(record["messages"])
        if args.chat:
            return tokenizer.encode_chat([{"role": "user", "content": record[args.json_key]}])
    except ChatTemplateError as exc:
        fail(PROG, str(exc))
    return tokenizer.encode(record[args.json_key])


def _write(out, record: dict, text, tokenizer, args: GenerateConfig) -> None:
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
    sections = parse_sections(argv, PROG, DESCRIPTION, GENERATE_SECTIONS)
    args = sections["generate"]
    records = _read_records(args)
    from tqdm import tqdm

    from tessera.inference.builder import build_engine
    from tessera.inference.sampling import SamplingParams
    from tessera.inference.text import generate_texts

    try:
        built = build_engine(sections["inference"])
    except ConfigError as exc:
        fail(PROG, str(exc))
    engine, tokenizer, parallel = built.engine, built.tokenizer, built.parallel
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
        texts = generate_texts(engine, tokenizer, prompts, params, stop=args.stop or [],
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
