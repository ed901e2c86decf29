"""Post-training on a CPU in a few minutes: a tiny chat model learns to sort letters.

    python examples/sft.py          # SFT: every weight trains on chats           (~40 s on 2 cores)
    python examples/sft.py --lora   # LoRA: adapters teach it a new order,
                                    #   exported for Hugging Face PEFT            (~1 minute)
    python examples/sft.py --dpo    # DPO: right answers preferred to the model's own
                                    #   wrong ones                                (~1 minute)
    make sft-demo                   # all three

1. base     a tokenizer with a ChatML template and a random 0.4M-parameter Llama, saved as a
            Hugging Face directory: it stands in for a model downloaded from the hub
2. data     generated chats, `{"messages": [...]}` JSONL ("sort qjfa" -> "afjq") and held-out
            prompts whose words are in no training row
3. before   `tessera generate` answers the held-out prompts (greedy)
4. train    `tessera train --sft` (or `--lora-rank`, or `--dpo`) starting from the base
5. after    the same prompts again, and the accuracy before and after

LoRA starts from the SFT model (made first if it is not there), as it would from an
instruction-tuned model from the hub. DPO starts from a weaker one, a shorter SFT run that gets
about half the answers right: its pairs are the right answer (chosen) and that model's own wrong
answer (rejected) to training prompts, answered with `tessera generate`. Every command is printed
as you would type it, then run in this process (`tessera.cli.run`). Everything goes under
runs/sft-demo/, built once and reused by later runs; --quick trains a few steps only (the test's
setting).

Held-out accuracy on 2 CPU cores: SFT 0% -> 92%; LoRA on the descending task 0% -> 71%; DPO
51% -> 75%. DPO's term alone lowers the right answers too and unlearns the task (3% at lr 3e-5);
the chosen answers' SFT loss beside it does much of the lifting (79% at --dpo-beta 0.01).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.tiny_chat_model import save_tiny_chat_model  # noqa: E402
from tessera.cli import run  # noqa: E402

WORK = ROOT / "runs" / "sft-demo"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# What every run shares: rows of 128 tokens hold a few packed chats each; no dropout (DPO needs none).
TRAIN = ["--tokenizer-type", "HuggingFaceTokenizer", "--split", "98,2,0", "--micro-batch-size", "8",
         "--global-batch-size", "8", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "50", "--eval-interval", "200",
         "--eval-iters", "2", "--num-workers", "0", "--seed", "1"]


def tessera(*args) -> None:
    """Print a command as a user types it, then run it in this process."""
    argv = [str(arg) for arg in args]
    print(f"\n$ tessera {shlex.join(argv)}", flush=True)
    if run(argv) != 0:
        raise SystemExit(f"tessera {argv[0]} failed")


# --- 2. data ----------------------------------------------------------------------------------------

def words(count: int, seed: int) -> list[str]:
    """`count` different words of 3 to 6 random letters."""
    rng, found = random.Random(seed), {}
    while len(found) < count:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        found[word] = None
    return list(found)


def sort_task(word: str, descending: bool = False) -> tuple[str, str]:
    """A user's question and its right answer."""
    return f"sort {'desc ' * descending}{word}", "".join(sorted(word, reverse=descending))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_prompts(path: Path, words: list[str], descending: bool = False) -> Path:
    """Questions for `tessera generate`, each with its right answer beside it."""
    return write_jsonl(path, [{"messages": [{"role": "user", "content": question}], "answer": answer}
                              for question, answer in (sort_task(word, descending) for word in words)])


def write_task(work: Path, train_words: list[str], heldout_words: list[str], descending: bool) -> tuple[Path, Path]:
    """Chats to train on and held-out prompts with their answers."""
    name = "desc" if descending else "sort"
    chats = [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
             for question, answer in (sort_task(word, descending) for word in train_words)]
    return (write_jsonl(work / f"{name}_chats.jsonl", chats),
            write_prompts(work / f"{name}_heldout.jsonl", heldout_words, descending))


def write_preferences(work: Path, model: Path, train_words: list[str]) -> Path:
    """DPO's pairs: the right answer chosen, `model`'s own wrong answer to the same prompt rejected."""
    prompts = write_prompts(work / "sort_prompts.jsonl", train_words)
    wrong = [row for row in answers(["--load", model], prompts)
             if row["completion"] != row["answer"] and row["completion"].strip()]  # a blank answer is no turn
    return write_jsonl(work / "sort_preferences.jsonl", [
        {"prompt": row["messages"][0]["content"], "chosen": row["answer"], "rejected": row["completion"]}
        for row in wrong])


# --- 3, 5. answers -------------------------------------------------------------------------------

def answers(model: list, prompts: Path) -> list[dict]:
    """Greedy answers of `model` (`--hf DIR` or `--load CK`) to `prompts`, saved beside them."""
    output = prompts.with_name(f"{prompts.stem}_{Path(model[1]).name}.jsonl")
    tessera("generate", *model, "--input", prompts, "--output", output, "--output-format", "jsonl",
            "--temperature", 0, "--max-new-tokens", 10)
    return [json.loads(line) for line in output.read_text().splitlines()]


def heldout_accuracy(model: list, heldout: Path, title: str, show: int = 5) -> float:
    """Greedy answers of `model` to the held-out prompts; the fraction right."""
    rows = answers(model, heldout)
    right = [row["completion"] == row["answer"] for row in rows]
    print(f"\n{title}:")
    for row, ok in list(zip(rows, right))[:show]:
        print(f"  {row['messages'][0]['content']!r:22} -> {row['completion']!r:10} {'right' if ok else 'wrong'}")
    accuracy = sum(right) / len(right)
    print(f"  held-out accuracy: {sum(right)}/{len(right)} = {accuracy:.0%}")
    return accuracy


# --- 4. training ---------------------------------------------------------------------------------

def sft(start: Path, tokenizer: Path, chats: Path, iters: int, out: Path, *lora_flags) -> Path:
    """`tessera train --sft` from `start`, a Hugging Face directory or a tessera checkpoint."""
    tessera("train", "--sft", *lora_flags, "--pretrained-checkpoint", start, "--tokenizer-model", tokenizer,
            "--data-path", chats, "--seq-length", 128, "--lr", "3e-3", "--min-lr", "1e-4", "--train-iters", iters,
            "--save", out, *TRAIN)
    return out


def dpo(base: Path, tokenizer: Path, pairs: Path, iters: int, out: Path) -> Path:
    # Answers a letter apart are where DPO alone lowers the right answer's probability too (Pal et al.
    # 2024, arXiv:2402.13228); the chosen answers' SFT loss beside it keeps them likely.
    tessera("train", "--dpo", "--dpo-beta", 0.1, "--dpo-sft-loss-weight", 1, "--pretrained-checkpoint", base,
            "--tokenizer-model", tokenizer, "--data-path", pairs, "--seq-length", 48, "--lr", "1e-3",
            "--min-lr", "1e-4", "--train-iters", iters, "--save", out, *TRAIN)
    return out


def answer_with_peft(hf_dir: Path, adapter: Path, question: str) -> str:
    """Greedy answer of transformers + PEFT: the exported adapter works outside tessera."""
    import torch
    import transformers
    from peft import PeftModel

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), adapter).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lora", action="store_true", help="train LoRA adapters on the SFT model; export for PEFT")
    mode.add_argument("--dpo", action="store_true",
                      help="DPO on a weaker SFT model: right answers over its own wrong ones")
    parser.add_argument("--quick", action="store_true", help="a few steps on little data: checks the pipeline")
    parser.add_argument("--work", type=Path, default=WORK, help=f"where everything goes [{WORK.relative_to(ROOT)}]")
    args = parser.parse_args(argv)
    work, scale = args.work, (0.05 if args.quick else 1)
    work.mkdir(parents=True, exist_ok=True)

    base = work / "base"
    if not (base / "config.json").exists():
        print(f"[1/5] base model: a random tiny Llama and a ChatML tokenizer -> {base}")
        save_tiny_chat_model(base)
    all_words = words(4000 + 100, seed=0)
    train_words, heldout_words = all_words[:4000], all_words[4000:4000 + (8 if args.quick else 100)]
    sort_chats, sort_heldout = write_task(work, train_words, heldout_words, descending=False)
    print(f"[2/5] data: {len(train_words)} chats in {sort_chats}, {len(heldout_words)} held-out prompts")

    sft_model = work / "sft"
    if not args.lora and not args.dpo:
        before = heldout_accuracy(["--hf", base], sort_heldout, "[3/5] the base model, before")
        print("\n[4/5] supervised fine-tuning: every weight trains, the loss is on the answers")
        sft(base, base, sort_chats, int(600 * scale), sft_model)
        after = heldout_accuracy(["--load", sft_model], sort_heldout, "[5/5] after SFT")
        return {"before": before, "after": after}
    if args.lora:
        if not (sft_model / "latest_checkpointed_iteration.txt").exists():
            print(f"\nfirst, the SFT model ({sft_model}):")
            sft(base, base, sort_chats, int(600 * scale), sft_model)
        chats, heldout = write_task(work, train_words, heldout_words, descending=True)
        print(f"\nLoRA's new task: descending order ({chats})")
        before = heldout_accuracy(["--load", sft_model], heldout, "[3/5] the SFT model, before")
        print("\n[4/5] LoRA: the SFT model frozen, rank-8 adapters on every linear layer train")
        out = sft(sft_model, base, chats, int(600 * scale), work / "lora", "--lora-rank", 8, "--lora-alpha", 16)
        after = heldout_accuracy(["--load", out], heldout, "[5/5] after LoRA")
        print("\nexport: the base as a Hugging Face model, the adapters as a PEFT adapter")
        tessera("convert", "tessera-to-hf", "--input", out, "--output", work / "lora-hf", "--peft-adapter",
                work / "lora-adapter")
        question = json.loads(heldout.read_text().splitlines()[0])["messages"][0]["content"]
        peft_answer = answer_with_peft(work / "lora-hf", work / "lora-adapter", question)
        print(f"\ntransformers + PeftModel.from_pretrained: {question!r} -> {peft_answer!r}")
        return {"before": before, "after": after, "peft_answer": peft_answer}

    weak_model = work / "sft-weak"
    if not (weak_model / "latest_checkpointed_iteration.txt").exists():
        print(f"\nfirst, a weaker SFT model, trained 120 steps instead of 600 ({weak_model}):")
        sft(base, base, sort_chats, max(30, int(120 * scale)), weak_model)  # fewer answer blanks only
    print("\nDPO's pairs: the weak model answers the training prompts; its wrong answers are rejected")
    pairs = write_preferences(work, weak_model, train_words[:int(4000 * scale)])
    before = heldout_accuracy(["--load", weak_model], sort_heldout, "[3/5] the weak SFT model, before")
    print("\n[4/5] DPO: the weak model learns to prefer the right answer; the reference is where it started")
    out = dpo(weak_model, base, pairs, int(400 * scale), work / "dpo")
    after = heldout_accuracy(["--load", out], sort_heldout, "[5/5] after DPO")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
