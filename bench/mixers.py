"""Mamba-2, Gated DeltaNet, hybrid stacks and GPT-OSS on one GPU: the mixers' kernels, training and decode.

On an H200 (mamba-ssm not installed; flash-linear-attention from its wheels, no internet needed):

    pip install --no-deps --target /tmp/site .whl/einops-*.whl .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl
    PYTHONPATH=/tmp/site python bench/mixers.py --out $OUT/mixers.jsonl          # --parts 1, then 2 3 4, to split it
    python bench/mixers.py --tiny           (a CPU smoke run of every row, tiny shapes)

Parts (`--parts 1 2 3 4`); each row in a process of its own, as bench/posttrain.py runs them (one
model's compiled graphs and memory do not meet the next's; a crash or an OOM costs that row only),
stopped after --row-timeout seconds with what it printed kept; rows that would start after --budget
seconds (300: the whole run's) are skipped. Inside a process every measurement is guarded: a
missing package, an OOM or a compile error is one line, and the next one runs.

1 kernels  Forward + backward ms of one layer at the Mamba-2 8B hybrid's width (`mamba2-hybrid-8b`:
           hidden 4096, seq 4096, batch 1, bf16 autocast over fp32 weights, as the trainer runs
           it): its Mamba-2 mixer (128 heads of 64, state 128, 8 groups) and a Gated DeltaNet
           mixer of Qwen3-Next's heads (16 query/key heads and 32 value heads of 128). Rows:
           tessera's HybridLayer (norm, mixer, residual) eager and under torch.compile (the
           trainer's per-layer compile and options), tessera's scan alone and its share of the
           eager layer, the layer with each library backend tessera's kernel module names
           (mamba_ssm for the SSD scan, fla for the delta rule), the best library kernel
           importable (SSD: mamba-ssm's mamba_chunk_scan_combined, else flash-linear-attention's
           chunk_simple_gla, which is the SSD recurrence with q = C, k = B, v = dt x, g = dt A;
           delta rule: fla's chunk_gated_delta_rule), and transformers' PyTorch paths
           (Mamba2Mixer's, imported with mamba-ssm, causal-conv1d and fla hidden so that it does
           not dispatch to them; Qwen3-Next's torch_chunk_gated_delta_rule). Each kernel row
           gives the max |difference| of its output from tessera's scan on the same random inputs.
2 train    8 layers of the 8B hybrid's pattern (its layers 5-12, "M--M-M*-": 3 Mamba-2, 1 attention,
           4 MLP) beside the same 8 layers as pure attention ("*-*-*-*-"), trained through
           bench/train_mfu.py's measure() with its flags (mock data, AdamW, bf16, the trainer's
           compile), micro-batch 1 x seq 4096, --warmup then --steps steps; MFU by the
           trainer's FLOPs (Megatron's count of the Mamba-2 layers).
3 gpt-oss  4 of GPT-OSS-20B's layers (32 experts, top-4), trained as in 2, beside the same layers
           with one dense MLP of the active width (top-k x expert ffn): the same FLOPs per token.
4 decode   The two models of 2 through tessera's engine (bench/generate.py's measure_batch: two
           untimed runs, then one timed; greedy, --prompt tokens in, --new out), batch 1 and 32,
           --decode-mode as generate.py's modes (default: the engine's CUDA default).

Prints one line a row and writes the rows as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm import timed  # noqa: E402
from generate import MODES, measure_batch, random_model  # noqa: E402
from posttrain import TINY  # noqa: E402
from train_mfu import COMMON, measure  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.inference.engine import Engine  # noqa: E402
from tessera.kernels import delta_rule, ssd  # noqa: E402
from tessera.models import gated_deltanet, mamba  # noqa: E402
from tessera.models.gpt import initialize_parameters  # noqa: E402
from tessera.models.hybrid import HybridLayer  # noqa: E402
from tessera.models.presets import PRESETS  # noqa: E402
from tessera.training.build import COMPILE_OPTIONS  # noqa: E402
from tessera.training.precision import autocast  # noqa: E402

HYBRID_8B = "mamba2-hybrid-8b"
HYBRID_LAYERS = PRESETS[HYBRID_8B]["hybrid_layer_pattern"][4:12]   # "M--M-M*-": its layers' mix (24/4/28 of 56)
ATTENTION_LAYERS = "*-" * 4
MIXER_TINY = ["--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
              "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
              "--linear-value-head-dim", "16"]
# The MoE fields of a preset back at their defaults (a top-k or an aux loss without experts is refused)
DENSE_YAML = ("num_experts: null\nmoe_ffn_hidden_size: null\nmoe_router_dtype: null\nmoe_router_topk: 2\n"
              "moe_grouped_gemm: false\nmoe_aux_loss_coeff: [0.0]\nffn_hidden_size: {ffn}\n")
SHAPE_FIELDS = {"M": ("hidden_size", "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups"),
                "G": ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                      "linear_value_head_dim", "linear_conv_kernel_dim")}
PARTS = {"1": ["mamba", "gdn"], "2": ["train-hybrid", "train-attention"], "3": ["gpt-oss-moe", "gpt-oss-dense"],
         "4": ["decode-hybrid", "decode-attention"]}
PAIRS = [("train-hybrid", "train-attention", "tokens_per_sec"), ("gpt-oss-moe", "gpt-oss-dense", "tokens_per_sec"),
         ("decode-hybrid", "decode-attention", "decode_tokens_per_s")]


# -- part 1: one mixer layer and its scans -------------------------------------------------------------

class Kernels:
    """One mixer's HybridLayer, an input, and forward + backward timings under the trainer's autocast."""

    def __init__(self, symbol: str, args: argparse.Namespace):
        self.config = model_config(["--model", HYBRID_8B, "--hybrid-layer-pattern", symbol] +
                                   (TINY + MIXER_TINY if args.tiny else []))
        self.cuda = torch.cuda.is_available() and not args.tiny
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.amp_dtype = torch.bfloat16 if self.cuda else None
        self.seq, self.repeats = args.seq, args.repeats
        with torch.device(self.device):
            self.layer = HybridLayer(self.config, symbol)
        initialize_parameters(self.layer, seed=0)
        self.x = torch.randn(1, self.seq, self.config.hidden_size, device=self.device, requires_grad=True)
        self.shape = {name: getattr(self.config, name) for name in SHAPE_FIELDS[symbol]} | dict(seq=self.seq)

    def ms(self, forward: Callable, leaves: list[torch.Tensor]) -> float:
        """Median ms of forward + backward (the gradients of `leaves`, not accumulated)."""
        def step():
            out = self.forward(forward)
            torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
        return timed(step, self.repeats, warmup=2) * 1e3

    def forward(self, forward: Callable) -> torch.Tensor:
        with autocast(self.device.type, self.amp_dtype):
            out = forward()
        return out[0] if isinstance(out, tuple) else out

    def difference(self, forward: Callable, reference: torch.Tensor) -> float:
        with torch.no_grad():
            return (self.forward(forward).float() - reference.float()).abs().max().item()

    def run_layer(self) -> torch.Tensor:
        return self.layer(self.x, None)

    def layer_ms(self, module: torch.nn.Module | None = None) -> float:
        """tessera's layer, or `module` (called on the input alone)."""
        if module is None:
            return self.ms(self.run_layer, [self.x, *self.layer.parameters()])
        return self.ms(lambda: module(self.x), [self.x, *module.parameters()])

    def randn(self, *shape: int, fp32: bool = False) -> torch.Tensor:
        dtype = torch.float32 if fp32 or not self.cuda else torch.bfloat16
        return torch.randn(*shape, device=self.device, dtype=dtype).requires_grad_()


@dataclass
class Mixer:
    """What part 1 times for one mixer beside its layer."""

    scan: Callable                       # tessera's scan, on `inputs`
    inputs: tuple[torch.Tensor, ...]
    model_module: types.ModuleType       # where the layer finds the scan, by `scan_name`
    scan_name: str
    backends: list[str]                  # the scan's library backends in tessera
    kernels: list[tuple[str, Callable | None]]   # (label, a scan on `inputs`, None where not importable)
    hf_mixer: Callable[[], torch.nn.Module] | None = None   # transformers' mixer on its PyTorch path


def kernel_rows(symbol: str, args: argparse.Namespace):
    """Part 1's rows for one mixer (M or G): (label, measurement), in the order measured."""
    bench = Kernels(symbol, args)
    mixer = (mamba_mixer if symbol == "M" else gdn_mixer)(bench)
    leaves = [t for t in mixer.inputs if t.requires_grad]
    layer_ms = {}

    @functools.cache
    def reference(kind: str) -> torch.Tensor:
        with torch.no_grad():
            return bench.forward(bench.run_layer if kind == "layer" else lambda: mixer.scan(*mixer.inputs))

    def timed_layer(key: str, module: torch.nn.Module | None = None, **extra) -> dict:
        layer_ms[key] = bench.layer_ms(module)
        return dict(ms=layer_ms[key], **extra)

    def with_backend(backend: str) -> dict:
        scan = functools.partial(getattr(mixer.model_module, mixer.scan_name), backend=backend)
        with mock.patch.object(mixer.model_module, mixer.scan_name, scan):
            return timed_layer(backend, max_abs_diff_vs_torch_layer=bench.difference(bench.run_layer,
                                                                                       reference("layer")))

    def timed_scan(layer_key: str, scan: Callable | None, **extra) -> dict:
        if scan is None:
            raise ImportError("not available")
        ms = bench.ms(lambda: scan(*mixer.inputs), leaves)
        return dict(ms=ms, share_of_layer=ms / layer_ms[layer_key] if layer_key in layer_ms else None, **extra)

    def timed_kernel(label: str, kernel: Callable | None) -> dict:
        # its layer: tessera's with the backend of that name, or transformers'
        return timed_scan(label.split()[0], kernel, tessera_max_abs=reference("scan").float().abs().max().item(),
                          max_abs_diff_vs_tessera=kernel and bench.difference(lambda: kernel(*mixer.inputs),
                                                                              reference("scan")))

    yield "tessera layer, eager", lambda: timed_layer("eager", shape=bench.shape)
    yield "tessera scan (torch)", lambda: timed_scan("eager", mixer.scan)
    for backend in mixer.backends:
        yield f"tessera layer, {backend} backend", functools.partial(with_backend, backend)
    if mixer.hf_mixer is not None:
        yield "transformers mixer, PyTorch path", lambda: timed_layer("transformers", mixer.hf_mixer())
    for label, kernel in mixer.kernels:
        yield label, functools.partial(timed_kernel, label, kernel)
    yield "tessera layer, compiled", lambda: compiled_layer(bench)


def compiled_layer(bench: Kernels) -> dict:
    if not bench.cuda:
        raise RuntimeError("skipped off CUDA (the trainer compiles on CUDA only)")
    bench.layer.compile(options=COMPILE_OPTIONS)   # as tessera.training.build compiles each layer
    start = time.perf_counter()
    out = bench.forward(bench.run_layer)
    torch.autograd.grad(out, [bench.x, *bench.layer.parameters()], torch.ones_like(out), allow_unused=True)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    return dict(ms=bench.layer_ms(), compile_s=compile_s)


def torch_paths(module: str) -> types.ModuleType:
    """transformers' `module` bound to its PyTorch paths. Newer releases bind a library's kernel in place
    of the PyTorch function when the library imports, so it is imported with the libraries hidden; older
    ones keep the PyTorch function under its own name and may import a library they found installed,
    so where hiding fails it is imported as it is."""
    libraries = ("fla", "mamba_ssm", "causal_conv1d")
    saved = {name: sys.modules.get(name) for name in libraries}
    sys.modules.update(dict.fromkeys(libraries))   # None: `import fla` raises ImportError
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    finally:
        for name, library in saved.items():
            if library is None:
                del sys.modules[name]
            else:
                sys.modules[name] = library
    return importlib.import_module(module)


def mamba_mixer(bench: Kernels) -> Mixer:
    config, seq = bench.config, bench.seq
    heads, head_dim, groups, state = (config.mamba_num_heads, config.mamba_head_dim, config.mamba_num_groups,
                                      config.mamba_state_dim)
    x = bench.randn(1, seq, heads, head_dim)
    B, C = (bench.randn(1, seq, groups, state) for _ in range(2))
    with torch.no_grad():   # time steps about 0.05; A as the mixer draws it
        dt = F.softplus(bench.randn(1, seq, heads, fp32=True) - 3).detach().requires_grad_()
        A = -torch.empty(heads, device=bench.device).uniform_(*mamba.A_INIT_RANGE)
    hf = torch_paths("transformers.models.mamba2.modeling_mamba2")

    def hf_mixer() -> torch.nn.Module:
        hf_config = hf.Mamba2Config(hidden_size=config.hidden_size, num_heads=heads, head_dim=head_dim,
                                    state_size=state, n_groups=groups, expand=heads * head_dim // config.hidden_size,
                                    chunk_size=ssd.CHUNK_SIZE, conv_kernel=mamba.CONV_KERNEL, use_bias=False,
                                    use_conv_bias=True, num_hidden_layers=1, vocab_size=256)
        with torch.device(bench.device):
            module = hf.Mamba2Mixer(hf_config, layer_idx=0)
        forward = getattr(module, "torch_forward", None)   # older releases name their PyTorch path
        return module if forward is None else _Bound(module, forward)

    hf_scan = getattr(hf, "mamba2_chunk_scan", None)   # newer releases have the scan on its own
    return Mixer(ssd.ssd_scan, (x, dt, A, B, C, torch.ones(heads, device=bench.device)), mamba, "ssd_scan",
                 [b for b in ssd.BACKENDS if b != "torch"],
                 [library_ssd(), ("transformers mamba2_chunk_scan", hf_scan and (
                     lambda x, dt, A, B, C, D: hf_scan(x, dt, A, B, C, ssd.CHUNK_SIZE, D=D)))],
                 hf_mixer)


class _Bound(torch.nn.Module):
    """A module whose call is another of its methods (transformers' Mamba2Mixer.torch_forward)."""

    def __init__(self, module: torch.nn.Module, forward: Callable):
        super().__init__()
        self.module, self._forward = module, forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._forward(hidden)


def gdn_mixer(bench: Kernels) -> Mixer:
    config, seq = bench.config, bench.seq
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    q, k = (bench.randn(1, seq, key_heads, config.linear_key_head_dim) for _ in range(2))
    v = bench.randn(1, seq, value_heads, config.linear_value_head_dim)
    with torch.no_grad():   # fla's tests' gates
        g = F.logsigmoid(bench.randn(1, seq, value_heads, fp32=True)).detach().requires_grad_()
        beta = bench.randn(1, seq, value_heads, fp32=True).sigmoid().detach().requires_grad_()
    torch_chunk_gated_delta_rule = torch_paths("transformers.models.qwen3_next.modeling_qwen3_next"
                                               ).torch_chunk_gated_delta_rule

    def hf_scan(q, k, v, g, beta):   # its caller repeats q and k over the value heads (Qwen3NextGatedDeltaNet)
        q, k = (t.repeat_interleave(value_heads // key_heads, dim=2) for t in (q, k))
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=delta_rule.CHUNK_SIZE,
                                            use_qk_l2norm_in_kernel=True)

    return Mixer(delta_rule.gated_delta_rule, (q, k, v, g, beta), gated_deltanet, "gated_delta_rule",
                 [b for b in delta_rule.BACKENDS if b != "torch"],
                 [library_delta_rule(), ("transformers torch_chunk_gated_delta_rule", hf_scan)])


def library_ssd() -> tuple[str, Callable | None]:
    """The best SSD kernel importable: (label, scan(x, dt, A, B, C, D) or None)."""
    with contextlib.suppress(ImportError):
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
        return "mamba_ssm mamba_chunk_scan_combined", functools.partial(ssd.ssd_scan, backend="mamba_ssm")
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return "fla chunk_simple_gla", None

    def scan(x, dt, A, B, C, D):   # the SSD recurrence is gated linear attention with one decay per head
        q, k = (t.repeat_interleave(x.shape[2] // B.shape[2], dim=2) for t in (C, B))
        y, _ = chunk_simple_gla(q, k, (x * dt.unsqueeze(-1)).to(x.dtype), g=dt * A, scale=1.0)
        return (y.float() + D[:, None] * x.float()).to(x.dtype)
    return "fla chunk_simple_gla", scan


def library_delta_rule() -> tuple[str, Callable | None]:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return "fla chunk_gated_delta_rule", None
    return "fla chunk_gated_delta_rule", functools.partial(chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True)


# -- parts 2-4: training through bench/train_mfu.py, decode through bench/generate.py ------------------

def model_config(flags: list[str]):
    """The ModelConfig that bench/train_mfu.py's flags and `flags` give."""
    return parse_run_config(COMMON + flags + ["--train-iters", "1"], "bench/mixers.py")[0].model


def model_flags(row: str, args: argparse.Namespace, directory: str) -> list[str]:
    if row.startswith("gpt-oss"):
        flags = ["--model", "tiny-gpt-oss" if args.tiny else "gpt-oss-20b", "--num-layers", "4",
                 "--seq-length", str(min(args.seq, 64) if args.tiny else args.seq)]
        if row == "gpt-oss-dense":
            moe = model_config(flags)
            path = Path(directory, "dense.yaml")
            path.write_text(DENSE_YAML.format(ffn=moe.moe_router_topk * moe.moe_ffn_hidden_size))
            flags += ["--config", str(path)]
        return flags + (["--device", "cpu"] if args.tiny else [])
    layers = HYBRID_LAYERS if row.endswith("hybrid") else ATTENTION_LAYERS
    return ["--model", HYBRID_8B, "--hybrid-layer-pattern", layers, "--seq-length", str(args.seq)] + \
        (TINY + MIXER_TINY if args.tiny else [])


def train_rows(row: str, args: argparse.Namespace):
    def train() -> dict:
        with tempfile.TemporaryDirectory() as directory:
            common = [flag for flag in COMMON if not (args.tiny and flag == "--bf16")]
            flags = common + model_flags(row, args, directory) + \
                ["--micro-batch-size", "1", "--train-iters", str(args.warmup + args.steps)]
            result = measure(flags, warmup=args.warmup, steps=args.steps)
        return {key: value for key, value in result.items() if key != "row"}
    yield "train", train


def decode_rows(row: str, args: argparse.Namespace):
    config = model_config(model_flags(row, args, ""))
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    model = random_model(config, device, torch.bfloat16 if cuda else torch.float32)
    mode = args.decode_mode if cuda else "eager"
    engine = Engine(model, max_requests=max(args.batches), **MODES[mode])
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        yield f"decode {mode} batch {batch}", functools.partial(measure_batch, engine, batch, args.prompt, args.new,
                                                                generator, device)


def run_row(args: argparse.Namespace) -> None:
    """This process's row: each measurement printed as `ROW {json}` when done, or its error in one line."""
    if args.row in ("mamba", "gdn"):
        measurements = kernel_rows("M" if args.row == "mamba" else "G", args)
    elif args.row.startswith("decode"):
        measurements = decode_rows(args.row, args)
    else:
        measurements = train_rows(args.row, args)
    for label, measure_one in measurements:
        record = dict(name=args.row, row=label)
        try:
            record.update(measure_one())
        except Exception as exc:   # an ImportError, an OOM, a compile error: one line, then the next
            record["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print("ROW " + json.dumps(record, default=str), flush=True)


# -- the driver --------------------------------------------------------------------------------------------

def run_process(command: list[str], timeout: float) -> tuple[str, str, str | None]:
    """(stdout, stderr, why it failed or None); a process that outlives `timeout` is killed with its
    children (torch.compile's workers) and what it printed is kept."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
        return out, err, f"exit status {process.returncode}" if process.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return out, err, f"timed out after {timeout:.0f} s"


def describe(record: dict) -> str:
    head = f"{record['name']:>16} | {record['row']:<44}"
    if "error" in record:
        return f"{head} {record['error']}"
    if "ms" in record:
        parts = [f"{record['ms']:9.2f} ms fwd+bwd"]
        if record.get("share_of_layer") is not None:
            parts.append(f"{record['share_of_layer']:.0%} of its layer")
        for key in ("max_abs_diff_vs_tessera", "max_abs_diff_vs_torch_layer"):
            if key in record:
                parts.append(f"max|diff| vs {key.split('_vs_')[1].replace('_', ' ')} {record[key]:.2e}")
        if "compile_s" in record:
            parts.append(f"compiled in {record['compile_s']:.0f} s")
        return f"{head} {' | '.join(parts)}"
    if "mfu" in record:
        return (f"{head} {record['tokens_per_sec']:9,.0f} tokens/s | {record['ms_per_step']:8.1f} ms/step | "
                f"{record['tflops_per_gpu']:6.1f} TFLOP/s | MFU {record['mfu']:6.1%} | "
                f"peak {record['peak_alloc_gib']:.1f} GiB")
    return (f"{head} {record['tokens_per_s']:9,.1f} tokens/s | decode {record['decode_tokens_per_s']:9,.1f} "
            f"tokens/s | first token {record['first_token_ms']:.1f} ms | warm-up {record['warmup_s']:.0f} s")


def compare(records: list[dict]) -> list[str]:
    """One line per pair of rows measured side by side: the first's speed over the second's."""
    lines = []
    for first, second, key in PAIRS:
        for a in (r for r in records if r["name"] == first and key in r):
            b = next((r for r in records if r["name"] == second and r["row"] == a["row"] and key in r), None)
            if b:
                lines.append(f"{first} / {second} ({a['row']}): {a[key] / b[key]:.2f}x {key}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5, help="part 1: timed forward + backward passes")
    parser.add_argument("--warmup", type=int, default=3, help="parts 2, 3: untimed training steps")
    parser.add_argument("--steps", type=int, default=5, help="parts 2, 3: timed training steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="part 4")
    parser.add_argument("--prompt", type=int, default=128, help="part 4")
    parser.add_argument("--new", type=int, default=256, help="part 4")
    parser.add_argument("--decode-mode", choices=MODES, default="compiled", help="part 4 (bench/generate.py's)")
    parser.add_argument("--row-timeout", type=float, default=150.0, help="seconds a row's process may run")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for every row: the rest are skipped")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks every row runs")
    parser.add_argument("--out", help="write the rows as JSON lines here")
    parser.add_argument("--row", help=argparse.SUPPRESS)   # one row, in this process
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq, args.repeats, args.warmup, args.steps = 256, 1, 1, 1
        args.batches, args.prompt, args.new = [1, 4], 8, 4
    return args


def main() -> None:
    args = parse_args()
    if args.row:
        return run_row(args)
    records, deadline = [], time.perf_counter() + args.budget
    for part in args.parts:
        for row in PARTS[part]:
            start = time.perf_counter()
            if deadline - start < 10:
                print(f"{row:>16} | skipped: --budget {args.budget:.0f} s spent", flush=True)
                continue
            out, err, failure = run_process([sys.executable, __file__, *sys.argv[1:], "--row", row],
                                            min(args.row_timeout, deadline - start))
            for line in out.splitlines():
                if line.startswith("ROW "):
                    records.append(dict(json.loads(line[4:]), part=int(part)))
                    print(describe(records[-1]), flush=True)
            if failure:
                last = (err.strip().splitlines() or ["(no output)"])[-1]
                print(f"{row:>16} | {failure}: {last}", flush=True)
            print(f"{row:>16} | {time.perf_counter() - start:.0f} s", flush=True)
    for line in compare(records):
        print(line)
    if args.out:
        partial = Path(args.out + ".partial")
        partial.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
        partial.rename(args.out)


if __name__ == "__main__":
    main()
