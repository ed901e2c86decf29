"""Preprocessing throughput: docs/s and MB/s for 1, 2, 4 workers, byte-level and BPE tokenizers.

    python bench/preprocess.py [--mb 200] [--workers 1 2 4] [--json results.json]

The corpus is the Python standard library's sources (real text, offline), repeated to
--mb megabytes of JSONL. For each tokenizer the script first times the tokenizer alone
(`tokenize_batch` in one process, one thread, over one copy of the corpus), then runs
the whole pipeline in a fresh process per worker count. "ratio" is pipeline throughput
over N x the tokenizer's own: 100% means the pipeline costs nothing beyond tokenizing.
"ratio to N tokenizers run at once" divides instead by N tokenizer processes running
together with no pipeline, which shows what the machine itself allows.
Peak memory (RSS of the main process, and of the largest worker) is measured on the full
corpus and on a quarter of it, to show that it does not grow with the input. Runs on the
CPU only; the CPU count bounds the scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the baseline is one thread, like one worker
os.environ["RAYON_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tessera.config import DataConfig  # noqa: E402
from tessera.data.corpus import build_stdlib_corpus  # noqa: E402
from tessera.data.tokenizers import build_tokenizer  # noqa: E402

BATCH = 64  # documents per tokenize_batch call in the baseline (about one worker block)


def tokenizer_configs(work: Path, unit: Path) -> dict[str, DataConfig]:
    from tessera.data.train_tokenizer import TrainingText, train_bpe_tokenizer

    bpe = work / "bpe" / "tokenizer.json"
    if not bpe.exists():
        start = time.perf_counter()
        train_bpe_tokenizer(TrainingText([str(unit)], max_bytes=8_000_000), str(bpe), vocab_size=32000)
        print(f"trained the BPE tokenizer (32k) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return {"byte": DataConfig(tokenizer_type="ByteTokenizer"),
            "bpe-32k": DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(bpe))}


def repeat_corpus(unit: Path, out: Path, megabytes: float) -> int:
    data = unit.read_bytes()
    copies = max(1, -(-int(megabytes * 1e6) // len(data)))
    with open(out, "wb") as f:
        for _ in range(copies):
            f.write(data)
    return copies


def tokenizer_alone(config: DataConfig, unit: Path) -> dict:
    """Documents/s and JSONL-MB/s of tokenize_batch alone (texts already parsed), one thread."""
    texts = [json.loads(line)["text"] for line in unit.read_bytes().splitlines()]
    tokenizer = build_tokenizer(config)
    for _ in range(2):  # time the second pass: a warm tokenizer (BPE word cache) is the fair bar
        start = time.perf_counter()
        tokens = sum(len(ids) for i in range(0, len(texts), BATCH)
                     for ids in tokenizer.tokenize_batch(texts[i:i + BATCH]))
        seconds = time.perf_counter() - start
    return {"docs_per_s": len(texts) / seconds, "mb_per_s": unit.stat().st_size / 1e6 / seconds, "tokens": tokens}


def _tokenizer_alone_task(args: tuple[dict, str]) -> dict:
    return tokenizer_alone(DataConfig(**args[0]), Path(args[1]))


def tokenizers_alone_in_parallel(config: DataConfig, unit: Path, processes: int) -> float:
    """Documents/s of `processes` independent tokenizers running at once: what the machine
    itself allows (shared caches, memory bandwidth, clock boost), with no pipeline at all."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        runs = pool.map(_tokenizer_alone_task, [(vars(config), str(unit))] * processes)
    return sum(run["docs_per_s"] for run in runs)


def run_child(config: DataConfig, corpus: Path, output: Path, workers: int) -> dict:
    """One pipeline run in a fresh process, so that its peak memory is its own."""
    request = json.dumps({"config": vars(config), "corpus": str(corpus), "output": str(output), "workers": workers})
    result = subprocess.run([sys.executable, __file__, "--child", request], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return json.loads(result.stdout.splitlines()[-1])


def child(request: str) -> None:
    from tessera.data.preprocess import preprocess

    request = json.loads(request)
    summary = preprocess([request["corpus"]], request["output"], DataConfig(**request["config"]),
                         workers=request["workers"], append_eod=True)
    kib = 1024 / 1e6
    print(json.dumps({
        "documents": summary.documents, "seconds": summary.seconds, "input_mb": summary.input_bytes / 1e6,
        "docs_per_s": summary.documents / summary.seconds, "mb_per_s": summary.input_bytes / 1e6 / summary.seconds,
        "tokens": summary.keys["text"].tokens,
        "peak_rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
        "peak_rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200, help="size of the JSONL corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--work-dir", help="where the corpus and outputs go (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(args.work_dir or temporary)
        work.mkdir(parents=True, exist_ok=True)
        unit, corpus, quarter = work / "stdlib.jsonl", work / "corpus.jsonl", work / "quarter.jsonl"
        documents, unit_bytes = build_stdlib_corpus(unit)
        copies = repeat_corpus(unit, corpus, args.mb)
        repeat_corpus(unit, quarter, args.mb / 4)
        print(f"corpus: {copies} x the standard library ({documents} files, {unit_bytes / 1e6:.1f} MB) = "
              f"{corpus.stat().st_size / 1e6:.0f} MB, {os.cpu_count()} CPUs", file=sys.stderr)
        results = {"cpus": os.cpu_count(), "corpus_mb": corpus.stat().st_size / 1e6, "runs": []}
        for name, config in tokenizer_configs(work, unit).items():
            alone = tokenizer_alone(config, unit)
            results.setdefault("tokenizer_alone", {})[name] = alone
            for workers in args.workers:
                run = run_child(config, corpus, work / f"out_{name}_{workers}", workers)
                parallel = tokenizers_alone_in_parallel(config, unit, workers)
                run.update(tokenizer=name, workers=workers, input="full",
                           ratio=run["docs_per_s"] / (workers * alone["docs_per_s"]),
                           ratio_to_parallel=run["docs_per_s"] / parallel)
                results["runs"].append(run)
                print(f"{name} x{workers}: {run['mb_per_s']:.1f} MB/s, ratio {run['ratio']:.0%}", file=sys.stderr)
            small = run_child(config, quarter, work / f"out_{name}_quarter", max(args.workers))
            small.update(tokenizer=name, workers=max(args.workers), input="quarter",
                         ratio=small["docs_per_s"] / (max(args.workers) * alone["docs_per_s"]),
                         ratio_to_parallel=None)
            results["runs"].append(small)
        print(table(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))


def table(results: dict) -> str:
    lines = [f"Corpus: the Python standard library repeated to {results['corpus_mb']:.0f} MB of JSONL; "
             f"{results['cpus']} CPUs; `--append-eod`.", "",
             "| tokenizer | workers | input MB | docs/s | MB/s | tokenizer alone x N (MB/s) | ratio | "
             "ratio to N tokenizers run at once | peak RSS main / worker (MB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in results["runs"]:
        alone = results["tokenizer_alone"][run["tokenizer"]]["mb_per_s"] * run["workers"]
        at_once = "-" if run["ratio_to_parallel"] is None else f"{run['ratio_to_parallel']:.0%}"
        lines.append(f"| {run['tokenizer']} | {run['workers']} | {run['input_mb']:.0f} | {run['docs_per_s']:,.0f} | "
                     f"{run['mb_per_s']:.1f} | {alone:.1f} | {run['ratio']:.0%} | {at_once} | "
                     f"{run['peak_rss_main_mb']:.0f} / {run['peak_rss_worker_mb']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
