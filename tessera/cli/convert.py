"""`tessera convert`: Hugging Face model directories <-> tessera checkpoints, offline."""

from __future__ import annotations

import argparse

from tessera.cli.args import fail
from tessera.config import ConfigError
from tessera.interop.hf_config import FAMILIES

PROG = "tessera convert"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Convert between Hugging Face and tessera checkpoints (Llama 2/3, Mistral, "
        "Qwen2/2.5, GPT-2, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3 with their MTP layers, Moonlight, "
        "Kimi-K2; local directories only).")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_tessera = sub.add_parser("hf-to-tessera", help="HF directory (config.json + safetensors) -> tessera checkpoint")
    to_tessera.add_argument("--input", required=True, metavar="HF_DIR")
    to_tessera.add_argument("--output", required=True, metavar="CKPT_DIR")
    to_tessera.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                            help="pad the vocabulary for tensor parallelism (Megatron's flag) [128]")
    to_tessera.add_argument("--peft-adapter", metavar="ADAPTER_DIR",
                            help="a PEFT LoRA adapter of the --input model: write a LoRA checkpoint holding both "
                            "(generate/serve merge it; train further with --pretrained-checkpoint and --lora-rank)")
    to_hf = sub.add_parser("tessera-to-hf", help="tessera checkpoint (its newest) -> HF directory, with the "
                           "checkpoint's tokenizer and generation_config.json")
    to_hf.add_argument("--input", required=True, metavar="CKPT_DIR")
    to_hf.add_argument("--output", required=True, metavar="HF_DIR")
    to_hf.add_argument("--model-type", choices=FAMILIES,
                       help="HF family (default: the imported one, else inferred from the architecture)")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                       help="weights dtype (default: the imported model's, else float32)")
    to_hf.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest safetensors file [5]")
    to_hf.add_argument("--peft-adapter", metavar="ADAPTER_DIR",
                       help="a LoRA checkpoint: write its base to --output and its adapters here as a PEFT adapter "
                       "(without it, --output gets the model with the adapters merged)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from tessera.interop.hf_checkpoint import hf_to_tessera, tessera_to_hf
    from tessera.interop.hf_fields import UnsupportedModel

    try:
        if args.direction == "hf-to-tessera":
            hf_to_tessera(args.input, args.output, vocab_multiple=args.make_vocab_size_divisible_by,
                          peft_adapter=args.peft_adapter)
            written = f" with the adapters of {args.peft_adapter}" if args.peft_adapter else ""
        else:
            tokenizer = tessera_to_hf(args.input, args.output, family=args.model_type, dtype=args.dtype,
                                      max_shard_bytes=int(args.max_shard_size_gb * 2**30),
                                      peft_adapter=args.peft_adapter)
            written = f" with {tokenizer}" + (f", and the adapters to {args.peft_adapter}" if args.peft_adapter else "")
    except (FileNotFoundError, UnsupportedModel, ConfigError) as exc:
        fail(f"{PROG} {args.direction}", str(exc))
    print(f"{PROG}: wrote {args.output}{written}")
    return 0
