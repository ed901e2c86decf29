"""Generation speed of tessera's engine on config B's shape (LLaMA-style 1.2B, random weights,
bf16), beside Hugging Face's generate() with a static cache and torch.compile, run on the same machine.

    python bench/generate.py [--batches 1 32] [--prompt 128] [--new 256] [--modes compiled graphs eager]

Greedy, no end-of-sequence stop, so every request makes all `--new` tokens. tokens/s =
batch x new / wall time of Engine.generate, prefill included (the anchor's measure);
also the time to the first token (prefill) and the decode rate after it. Each setting
runs twice untimed first (the first compiles the decode step and captures its CUDA
graphs), each run on fresh random prompts (no prefix-cache hits). Modes: `compiled` =
CUDA graphs of the torch.compile'd decode step (the engine's default on CUDA), `graphs` =
CUDA graphs of the eager step, `eager` = neither. Each RESULT says what the GPU's clock, power
and temperature were during the timed run (bench/gpu_state.py). Prints a table and RESULT lines; writes
$OUT/generate.json when OUT is set. `--config tiny` runs a small model (a CPU check);
`--profile` prints the kernels of 16 decode steps of the first mode at each batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_state import GpuSampler  # noqa: E402
from tessera.config import ModelConfig  # noqa: E402
from tessera.inference.cuda_graphs import row_bucket  # noqa: E402
from tessera.inference.engine import Engine  # noqa: E402
from tessera.inference.sampling import SamplingParams  # noqa: E402
from tessera.models.gpt import GPTModel, initialize_parameters  # noqa: E402

CONFIGS = {
    # bench/train_mfu.py's config B; positions as the reference's LlamaConfig (4096)
    "B": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, group_query_attention=True,
              num_query_groups=4, ffn_hidden_size=5632, seq_length=2048, max_position_embeddings=4096,
              vocab_size=32000, rotary_base=500000.0),
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, group_query_attention=True,
                 num_query_groups=2, ffn_hidden_size=256, seq_length=512, max_position_embeddings=512,
                 vocab_size=1000, rotary_base=10000.0),
}
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
MODES = {"compiled": dict(cuda_graphs=True, compile=True), "graphs": dict(cuda_graphs=True, compile=False),
         "eager": dict(cuda_graphs=False, compile=False)}


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> GPTModel:
    return random_model(ModelConfig(**CONFIGS[name], **LLAMA), device, dtype)


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> GPTModel:
    """A GPTModel of `config` with seed-0 random weights in `dtype`, ready for an Engine."""
    with torch.device(device):
        model = GPTModel(config)
    initialize_parameters(model, seed=0)
    return model.to(dtype).eval()


def timed_run(engine: Engine, batch: int, prompt: int, new: int, generator: torch.Generator) -> dict:
    """One generate() of `batch` random prompts: wall time, and the time until every request has a token."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    prompts = torch.randint(0, engine.vocab_size, (batch, prompt), generator=generator).tolist()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    first, tokens = None, 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.token_ids) for o in engine.step())
        if first is None and tokens >= batch:   # greedy, no EOS: every request gets one token per step
            first = time.perf_counter() - start
    sync()
    elapsed = time.perf_counter() - start
    assert tokens == batch * new, (tokens, batch * new)
    return dict(elapsed=elapsed, first=first)


def measure_batch(engine: Engine, batch: int, prompt: int, new: int, generator: torch.Generator,
                  device: torch.device) -> dict:
    """Two untimed runs of `batch` requests (compilation, graph capture), then a timed one: its speeds."""
    start = time.perf_counter()
    for _ in range(2):
        timed_run(engine, batch, prompt, new, generator)
    warmup = time.perf_counter() - start
    with GpuSampler(device.index or 0) as gpu:
        run = timed_run(engine, batch, prompt, new, generator)
        graph = None if device.type != "cuda" else graph_ms(engine, batch)
    return dict(batch=batch, prompt=prompt, new_tokens=new, tokens_per_s=round(batch * new / run["elapsed"], 1),
                ms_per_token=round(run["elapsed"] / new * 1e3, 3), first_token_ms=round(run["first"] * 1e3, 2),
                decode_tokens_per_s=round(batch * (new - 1) / (run["elapsed"] - run["first"]), 1),
                warmup_s=round(warmup, 1), graph_ms=graph,
                peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
                gpu=gpu.summary())


def graph_ms(engine: Engine, batch: int, replays: int = 50) -> float | None:
    """GPU time of one decode step: the widest CUDA graph captured for `batch` rows replayed
    back to back (what the step would cost with no host work between steps)."""
    graphs = engine.runner.graphs
    keys = [key for key in (graphs.graphs if graphs else ()) if key[0] == row_bucket(batch)]
    if not keys:
        return None
    graph, _ = graphs.graphs[max(keys)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def profile_decode(engine: Engine, batch: int, prompt: int, generator: torch.Generator, steps: int = 16) -> str:
    """torch.profiler's kernel table (by GPU time) over `steps` decode steps, prefill excluded."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i, ids in enumerate(torch.randint(0, engine.vocab_size, (batch, prompt), generator=generator).tolist()):
        engine.add_request(f"profile-{i}", ids, params)
    while sum(len(o.token_ids) for o in engine.step()) < batch:
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="B", choices=CONFIGS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.config, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    records = []
    for mode in args.modes:
        engine = Engine(model, max_requests=max(args.batches), **MODES[mode])
        generator = torch.Generator().manual_seed(0)
        for batch in args.batches:
            record = dict(row=f"tessera-engine-{mode}", config=args.config, params=params,
                          **measure_batch(engine, batch, args.prompt, args.new, generator, device))
            print("RESULT " + json.dumps(record), flush=True)
            records.append(record)
            if args.profile and mode == args.modes[0] and device.type == "cuda":
                table = profile_decode(engine, batch, args.prompt, generator)
                print(f"decode kernels, {mode}, batch {batch}:\n{table}", flush=True)
                if os.environ.get("OUT"):
                    Path(os.environ["OUT"], f"profile_{mode}_b{batch}.txt").write_text(table)
        del engine
    print(f"\n{'row':<26} {'batch':>5} {'tokens/s':>10} {'ms/token':>9} {'first ms':>9} {'decode tok/s':>12} "
          f"{'graph ms':>9}")
    for r in records:
        print(f"{r['row']:<26} {r['batch']:>5} {r['tokens_per_s']:>10.1f} {r['ms_per_token']:>9.3f} "
              f"{r['first_token_ms']:>9.2f} {r['decode_tokens_per_s']:>12.1f} {r['graph_ms'] or 0:>9.3f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "generate.json").write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
