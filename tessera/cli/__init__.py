"""Command dispatch: each command lives in its own module with a `main(argv) -> int`.

Modules are imported only when their command runs, so `tessera --help` stays fast.
"""

import importlib
import sys

# command name -> (module, one-line description)
COMMANDS = {
    "train": ("tessera.cli.train", "train a model (Megatron-LM flag names)"),
    "flops": ("tessera.cli.flops", "parameters, FLOPs per token/iteration and the MFU a speed means"),
    "plan": ("tessera.cli.plan", "predict memory, step time and MFU at any scale; choose the parallel layout"),
    "preprocess": ("tessera.cli.preprocess", "tokenize JSONL into Megatron .bin/.idx datasets"),
    "train-tokenizer": ("tessera.cli.train_tokenizer", "train a BPE tokenizer.json on JSONL text, offline"),
    "merge-datasets": ("tessera.cli.merge_datasets", "concatenate .bin/.idx datasets into one"),
    "convert": ("tessera.cli.convert", "Hugging Face <-> tessera checkpoints (Llama, Qwen, Mistral, GPT-2, Mixtral, DeepSeek)"),
    "generate": ("tessera.cli.generate", "sample text from a checkpoint or HF directory (a prompt or a JSONL file)"),
    "serve": ("tessera.cli.serve", "OpenAI-compatible HTTP server (completions, chat, streaming) and Megatron's /api"),
}


def _usage() -> str:
    lines = ["usage: tessera <command> [options]", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    for name, (_, description) in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {description}")
    lines.append("")
    lines.append("Run `tessera <command> --help` for the options of one command.")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"tessera: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)
