"""`tessera flops`: parameters (total and, for MoE, active per token), FLOPs per token and
iteration, and the MFU a speed means."""

from __future__ import annotations

import argparse
import dataclasses
import json

from tessera.cli.args import build_parser, fail, resolve
from tessera.config import ConfigError, ModelConfig
from tessera.perf.flops import ParamCount, count_parameters, flops_per_iteration, flops_per_token
from tessera.perf.hardware import GPUS, lookup_gpu

PROG = "tessera flops"


def _extra(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("throughput (optional: give one speed to get TFLOP/s/GPU and MFU)")
    group.add_argument("--global-batch-size", type=int, default=1, help="sequences per iteration")
    group.add_argument("--tokens-per-sec", type=float, help="measured tokens/s over all GPUs")
    group.add_argument("--iter-time", type=float, help="measured seconds per iteration")
    group.add_argument("--num-gpus", type=int, default=1, help="GPUs that produced that speed")
    group.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU for the peak")
    group.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8", "tf32", "fp32"))
    group.add_argument("--peak-tflops", type=float, help="override the GPU's dense peak TFLOP/s")
    group.add_argument("--json", action="store_true", help="print one JSON object")


def main_model_parameters(model: ModelConfig) -> ParamCount:
    """The parameters without the MTP depths, as model cards count them (DeepSeek-V3's 671B)."""
    return count_parameters(dataclasses.replace(model, mtp_num_layers=None))


def parameter_summary(model: ModelConfig) -> str:
    """'671.0B parameters (+11.6B in 1 MTP depth), 37.6B active per token' (the parts that apply)."""
    params, mtp = main_model_parameters(model), count_parameters(model).mtp
    depths = f" (+{mtp / 1e9:.1f}B in {model.mtp_num_layers} MTP depth{'s' * (model.mtp_num_layers > 1)})" if mtp else ""
    active = f", {params.active / 1e9:.1f}B active per token" if params.inactive else ""
    return f"{params.total / 1e9:.1f}B parameters{depths}{active}"


def report(model: ModelConfig, args: argparse.Namespace) -> dict:
    params = main_model_parameters(model)
    per_iteration = flops_per_iteration(model, args.global_batch_size)
    result = {
        "parameters": params.total, "active_parameters": params.active, "embedding_parameters": params.embedding,
        "non_embedding_parameters": params.non_embedding, "mtp_parameters": count_parameters(model).mtp,
        # DeepSeek's count of activated parameters: a token reads one row of an untied input embedding
        "active_parameters_without_input_embedding":
            params.active - (0 if model.tie_embeddings else model.padded_vocab_size() * model.hidden_size),
        "padded_vocab_size": model.padded_vocab_size(),
        "seq_length": model.seq_length, "global_batch_size": args.global_batch_size,
        "flops_per_token": flops_per_token(model), "flops_per_iteration": per_iteration,
    }
    tokens_per_iteration = args.global_batch_size * model.seq_length
    if args.tokens_per_sec or args.iter_time:
        iter_time = args.iter_time or tokens_per_iteration / args.tokens_per_sec
        tflops = per_iteration / iter_time / args.num_gpus / 1e12
        peak = args.peak_tflops or lookup_gpu(args.gpu).peak_tflops.get(args.dtype)
        result.update(iter_time_s=iter_time, tokens_per_sec=tokens_per_iteration / iter_time,
                      tflops_per_gpu=tflops, peak_tflops=peak, mfu=tflops / peak if peak else None)
    return result


def main(argv: list[str]) -> int:
    parser = build_parser(PROG, ["model"], "Count parameters and model FLOPs (Megatron-LM's formula).", _extra)
    args = parser.parse_args(argv)
    if args.tokens_per_sec and args.iter_time:
        fail(PROG, "give --tokens-per-sec or --iter-time, not both")
    try:
        model = ModelConfig(**resolve(args, ["model"])["model"])
        result = report(model, args)
    except (ConfigError, ValueError) as exc:
        fail(PROG, str(exc))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"parameters:         {result['parameters'] / 1e9:10.3f} B  "
          f"(embedding {result['embedding_parameters'] / 1e9:.3f} B, "
          f"non-embedding {result['non_embedding_parameters'] / 1e9:.3f} B; vocab padded to {result['padded_vocab_size']})")
    if model.num_experts:
        print(f"active per token:   {result['active_parameters'] / 1e9:10.3f} B  "
              f"({model.moe_router_topk} of {model.num_experts} experts; FLOPs count these; "
              f"{result['active_parameters_without_input_embedding'] / 1e9:.3f} B without the input embedding, "
              "as DeepSeek counts)")
    if result["mtp_parameters"]:
        print(f"MTP depths:         {result['mtp_parameters'] / 1e9:10.3f} B  "
              f"(--mtp-num-layers {model.mtp_num_layers}, beside the above; FLOPs count their work too)")
    print(f"FLOPs per token:    {result['flops_per_token'] / 1e9:10.3f} GFLOP  (forward + backward, seq {model.seq_length})")
    print(f"FLOPs per iteration:{result['flops_per_iteration'] / 1e12:10.3f} TFLOP  (global batch {args.global_batch_size})")
    if "tflops_per_gpu" in result:
        mfu = f"{result['mfu'] * 100:.1f}%" if result["mfu"] is not None else "n/a"
        print(f"at {result['tokens_per_sec']:,.0f} tokens/s on {args.num_gpus} GPU(s): "
              f"{result['tflops_per_gpu']:.1f} TFLOP/s/GPU, MFU {mfu} of {result['peak_tflops']} ({args.gpu} {args.dtype})")
    return 0
