"""Megatron-LM flags that tessera takes in other words, or has no use for, so that a Megatron
launch script runs unchanged.

- ALIASES: Megatron's shorthands and older spellings. Each sets the tessera flag it means, as
  megatron/training/arguments.py does (`validate_args`: --recompute-activations is selective
  recomputation; older releases' --fp8-hybrid / --fp8-e4m3 chose the FP8 format).
- IGNORED: switches between Megatron's and Transformer Engine's kernels, logging backends and
  profiling hooks. tessera has one implementation of each; the flag is accepted, and one note at
  start names what was ignored and why, so nothing is dropped in silence.
- UNSUPPORTED: Megatron features tessera does not have. They stop the run with one line that
  says what to use instead, rather than a "did you mean" that points at another flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

# alias -> (tessera flag, the value it sets)
ALIASES: dict[str, tuple[str, Any]] = {
    "--recompute-activations": ("--recompute-granularity", "selective"),
    "--fp8-hybrid": ("--fp8-format", "hybrid"),
    "--fp8-e4m3": ("--fp8-format", "e4m3"),
    "--use-rotary-position-embeddings": ("--position-embedding-type", "rope"),
    "--use-custom-fsdp": ("--use-megatron-fsdp", True),
}


@dataclass(frozen=True)
class Ignored:
    reason: str
    takes_value: bool = False
    nargs: str | None = None


_KERNELS = "tessera chooses its own kernels (torch.compile, Triton, cuBLAS, SDPA)"
_LOGS = "tessera logs loss, learning rate, grad norm, throughput, MFU and memory (--log-json, --tensorboard-dir)"
_PROFILE = "profile with bench/profile_step.py or torch.profiler"

IGNORED: dict[str, Ignored] = {
    "--use-mcore-models": Ignored("tessera has one model implementation"),
    "--transformer-impl": Ignored("tessera's layers are its own (PyTorch and Triton), not Transformer Engine's",
                                  takes_value=True),
    "--no-masked-softmax-fusion": Ignored(_KERNELS),
    "--no-bias-gelu-fusion": Ignored(_KERNELS),
    "--no-bias-swiglu-fusion": Ignored(_KERNELS),
    "--no-bias-dropout-fusion": Ignored(_KERNELS),
    "--no-rope-fusion": Ignored(_KERNELS),
    "--no-gradient-accumulation-fusion": Ignored(_KERNELS),
    "--no-persist-layer-norm": Ignored(_KERNELS),
    "--cross-entropy-loss-fusion": Ignored(_KERNELS),
    "--moe-permute-fusion": Ignored(_KERNELS),
    "--attention-softmax-in-fp32": Ignored("SDPA accumulates the softmax in fp32 already"),
    # Megatron-Core reads --attention-backend only; its --use-flash-attn is the legacy models' switch.
    "--use-flash-attn": Ignored("--attention-backend chooses the kernel (auto: cuDNN's, then FlashAttention's on "
                                "Hopper; --attention-backend flash forces FlashAttention)"),
    "--no-async-tensor-model-parallel-allreduce": Ignored(_KERNELS),
    "--distributed-backend": Ignored("tessera uses NCCL on GPUs and gloo on CPUs", takes_value=True),
    "--use-distributed-checkpoint": Ignored("tessera's checkpoints are always torch.distributed.checkpoint"),
    "--ckpt-format": Ignored("tessera's checkpoints are always torch.distributed.checkpoint", takes_value=True),
    "--auto-detect-ckpt-format": Ignored("tessera's checkpoints are always torch.distributed.checkpoint"),
    "--dist-ckpt-strictness": Ignored("tessera loads every tensor it saves, strictly", takes_value=True),
    "--no-create-attention-mask-in-dataloader": Ignored("tessera's loaders never build an attention mask"),
    "--no-mmap-bin-files": Ignored("tessera always memory-maps .bin files"),
    "--calculate-per-token-loss": Ignored("tessera always averages the loss over the global batch's tokens"),
    "--grad-reduce-in-bf16": Ignored("tessera's default under --bf16 (--accumulate-allreduce-grads-in-fp32 "
                                     "reduces in fp32)"),
    # Megatron stores a norm's scale as (scale - 1), so that weight decay pulls it to 1; tessera, like
    # Megatron by default, applies no weight decay to norms, which makes the two the same model.
    "--apply-layernorm-1p": Ignored("norms are not weight-decayed, so storing their scale minus one "
                                    "trains the same model"),
    "--log-throughput": Ignored("tessera always logs throughput"),
    "--log-timers-to-tensorboard": Ignored(_LOGS),
    "--log-memory-to-tensorboard": Ignored(_LOGS),
    "--log-validation-ppl-to-tensorboard": Ignored(_LOGS),
    "--log-params-norm": Ignored(_LOGS),
    "--log-num-zeros-in-grad": Ignored(_LOGS),
    "--timing-log-level": Ignored(_LOGS, takes_value=True),
    "--logging-level": Ignored(_LOGS, takes_value=True),
    "--wandb-project": Ignored("no Weights & Biases logging: use --tensorboard-dir or --log-json", takes_value=True),
    "--wandb-exp-name": Ignored("no Weights & Biases logging: use --tensorboard-dir or --log-json", takes_value=True),
    "--wandb-save-dir": Ignored("no Weights & Biases logging: use --tensorboard-dir or --log-json", takes_value=True),
    "--use-nccl-ub": Ignored("NCCL user buffers are Megatron-FSDP's; tessera shards with FSDP2"),
    "--fsdp-double-buffer": Ignored("a Megatron-FSDP buffer option; tessera shards with FSDP2"),
    "--fsdp-manual-registration": Ignored("a Megatron-FSDP buffer option; tessera shards with FSDP2"),
    "--init-model-with-meta-device": Ignored("tessera builds each rank's shard of the model directly"),
    "--empty-unused-memory-level": Ignored("tessera leaves PyTorch's caching allocator alone", takes_value=True),
    "--manual-gc": Ignored("tessera leaves Python's garbage collector alone"),
    "--manual-gc-interval": Ignored("tessera leaves Python's garbage collector alone", takes_value=True),
    "--profile": Ignored(_PROFILE),
    "--profile-step-start": Ignored(_PROFILE, takes_value=True),
    "--profile-step-end": Ignored(_PROFILE, takes_value=True),
    "--profile-ranks": Ignored(_PROFILE, takes_value=True, nargs="+"),
    "--use-pytorch-profiler": Ignored(_PROFILE),
    "--record-memory-history": Ignored("see bench/train_mfu.py --memory-trace"),
    "--memory-snapshot-path": Ignored("see bench/train_mfu.py --memory-trace", takes_value=True),
}

UNSUPPORTED: dict[str, str] = {
    "--rampup-batch-size": "tessera trains at one --global-batch-size",
    "--step-batch-size-schedule": "tessera trains at one --global-batch-size",
    "--recompute-modules": "--recompute-granularity selective recomputes attention's core; full recomputes layers",
    "--checkpoint-activations": "use --recompute-activations, or --recompute-granularity and --recompute-method",
}


class _Alias(argparse.Action):
    def __init__(self, option_strings, dest, target: str, target_dest: str, value: Any, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
                         help=f"Megatron-LM's spelling of {target} {value}" if value is not True else
                         f"Megatron-LM's spelling of {target}", **kwargs)
        self.target, self.target_dest, self.value = target, target_dest, value

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.target_dest, self.value)
        if given != self.value:
            parser.error(_contradiction(option_string, self, given))
        setattr(namespace, self.target_dest, self.value)
        uses = getattr(namespace, "_aliases", [])
        setattr(namespace, "_aliases", uses + [(option_string, self)])


class _Ignore(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, "_ignored", getattr(namespace, "_ignored", []) + [option_string])


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (Megatron-LM) is not supported: {UNSUPPORTED[option_string]}")


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The alias, ignored and unsupported flags, under their own headings of --help (after the
    tessera flags they point at have been added)."""
    known = parser._option_string_actions
    aliases = parser.add_argument_group("Megatron-LM spellings (each sets the tessera flag it names)")
    for alias, (target, value) in ALIASES.items():
        if target in known:   # commands without that section take neither
            aliases.add_argument(alias, action=_Alias, target=target, target_dest=known[target].dest, value=value)
    ignored = parser.add_argument_group("Megatron-LM flags accepted with no effect (a note at start names them)")
    for name, spec in IGNORED.items():
        nargs = spec.nargs or (None if spec.takes_value else 0)
        ignored.add_argument(name, action=_Ignore, nargs=nargs, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                             metavar="VALUE" if spec.takes_value else None, help=spec.reason)
    for name in UNSUPPORTED:
        parser.add_argument(name, action=_Refuse, nargs="*", dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def check_aliases(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
    """An alias and the flag it stands for, given with different values, is an error: which one
    was meant cannot be told from the command line."""
    for alias, action in getattr(namespace, "_aliases", []):
        given = getattr(namespace, action.target_dest)
        if given != action.value:
            parser.error(_contradiction(alias, action, given))


def _contradiction(alias: str, action: _Alias, given: Any) -> str:
    return f"{alias} means {action.target} {action.value}, but {action.target} {given} is given too"


def ignored_note(namespace: argparse.Namespace) -> str | None:
    """One line naming the Megatron-LM flags that were accepted and have no effect here."""
    by_reason: dict[str, list[str]] = {}
    for name in dict.fromkeys(getattr(namespace, "_ignored", [])):
        by_reason.setdefault(IGNORED[name].reason, []).append(name)
    if not by_reason:
        return None
    return "note: Megatron-LM flags with no effect here: " + "; ".join(
        f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())
