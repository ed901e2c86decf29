"""`tessera generate` on a tiny HF directory and on the tessera checkpoint converted from it.

Oracle: transformers' own greedy `generate()` on the same HF model.
"""

import json

import pytest
import torch
import transformers

from tessera.cli import run
from tessera.inference.text import HF_TOKENIZER_FILES
from tests.inference.tiny_text_model import hf_dir, tokenizer  # noqa: F401 -- fixtures


def _hf_greedy(hf_dir, ids, new_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_prompt_equals_transformers_generate_as_text_and_jsonl(hf_dir, tokenizer, tmp_path, capsys):
    prompt = "The quick brown"
    expected = _hf_greedy(hf_dir, tokenizer.encode(prompt), 10)
    out = tmp_path / "out.jsonl"
    greedy = ["--hf", str(hf_dir), "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "0"]
    assert run(["generate", *greedy, "--output-format", "jsonl", "--output", str(out)]) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["token_ids"] == expected and record["prompt"] == prompt
    assert record["completion"] == tokenizer.decode(expected)
    assert record["tokens"] == [tokenizer.token_text(t) for t in expected]
    assert len(record["logprobs"]) == len(expected) and all(v <= 0 for v in record["logprobs"])
    capsys.readouterr()
    assert run(["generate", *greedy]) == 0
    printed = capsys.readouterr()
    assert printed.out == prompt + tokenizer.decode(expected) + "\n\n"
    assert "tokens/s" in printed.err.splitlines()[-1]


def test_a_jsonl_file_of_prompts_and_chats_with_log_probs_and_a_progress_bar(hf_dir, tokenizer, tmp_path, capsys):
    lines = [{"id": 1, "prompt": "héllo"}, {"id": 2, "messages": [{"role": "user", "content": "你好"}]},
             {"id": 3, "prompt": "def main():"}]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert run(["generate", "--hf", str(hf_dir), "--input", str(source), "--output", str(out), "--output-format",
                "jsonl", "--max-new-tokens", "6", "--ignore-eos", "--top-logprobs", "2", "--seed", "7"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3]
    assert records[1]["prompt_tokens"] == len(tokenizer.encode_chat(lines[1]["messages"]))
    for record in records:
        assert len(record["token_ids"]) == len(record["tokens"]) == len(record["logprobs"]) == 6
        assert all(len(top) <= 2 for top in record["top_logprobs"]) and record["finish_reason"] == "length"
    err = capsys.readouterr().err
    assert "3/3" in err and "prompt" in err   # tqdm's bar, in prompts
    assert "18 generated" in err and "tokens/s" in err


def test_a_converted_checkpoint_generates_what_its_hf_directory_does(hf_dir, tmp_path, capsys):
    assert run(["convert", "hf-to-tessera", "--input", str(hf_dir), "--output", str(tmp_path / "ckpt")]) == 0
    outputs = []
    # the conversion copies the tokenizer files: --load needs no --tokenizer-model
    for source in (["--hf", str(hf_dir)], ["--load", str(tmp_path / "ckpt")],
                   ["--load", str(tmp_path / "ckpt"), "--tokenizer-model", str(hf_dir)]):
        out = tmp_path / f"{len(outputs)}.jsonl"
        assert run(["generate", *source, "--prompt", "tessera", "--max-new-tokens", "8", "--temperature", "0",
                    "--output-format", "jsonl", "--output", str(out)]) == 0
        outputs.append(json.loads(out.read_text())["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_checkpoint_without_tokenizer_files_names_the_flags_to_give(hf_dir, tmp_path, capsys):
    assert run(["convert", "hf-to-tessera", "--input", str(hf_dir), "--output", str(tmp_path / "ckpt")]) == 0
    for name in HF_TOKENIZER_FILES:
        (tmp_path / "ckpt" / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        run(["generate", "--load", str(tmp_path / "ckpt"), "--prompt", "tessera"])
    assert "pass --tokenizer-type and --tokenizer-model" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--input", "/nonexistent.jsonl"], "--input /nonexistent.jsonl"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "x " * 300], "the context holds 256"),
    (["--prompt", "x", "--tokenizer-model", "/nonexistent"], "--tokenizer-model /nonexistent"),
    (["--prompt", "x", "--output", "/nonexistent/out.jsonl"], "--output /nonexistent/out.jsonl: its directory"),
    (["--prompt", "x", "--load", "/nonexistent"], "--load and --hf are exclusive"),
    (["--prompt", "x", "--inference-max-requests", "0"], "--inference-max-requests must be >= 1, got 0"),
    (["--prompt", "x", "--output-format", "csv"], "--output-format: invalid choice"),
    (["--prompt", "x", "--max-new-token", "3"], "did you mean --max-new-tokens?"),
])
def test_bad_flags_stop_with_one_line_naming_them(hf_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(["generate", "--hf", str(hf_dir), *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_model_and_a_prompt_are_required_in_one_line(capsys):
    for flags, message in ((["--prompt", "x"], "give the model: --load CKPT_DIR or --hf HF_DIR"),
                           (["--hf", "/x"], "give --prompt TEXT or --input FILE.jsonl")):
        with pytest.raises(SystemExit) as stopped:
            run(["generate", *flags])
        err = capsys.readouterr().err.strip()
        assert stopped.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_a_jsonl_line_without_a_prompt_is_named(hf_dir, tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(SystemExit):
        run(["generate", "--hf", str(hf_dir), "--input", str(source)])
    assert f"{source}:2: needs a string 'prompt'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, caching", [([], False), (["--inference-dynamic-batching-prefix-caching"], True)])
def test_prefix_caching_is_off_unless_asked_for(hf_dir, flags, caching):
    """Megatron's flag and default: on a GPU a prompt after a cached prefix runs eagerly, slower than
    recomputing a short prefix through the prompt graphs."""
    from tessera.cli.args import parse_sections
    from tessera.config.inference import InferenceConfig
    from tessera.inference.builder import build_engine

    config = parse_sections(["--hf", str(hf_dir), *flags], "tessera generate", "", {"inference": InferenceConfig})
    assert build_engine(config["inference"]).engine.cache.allocator.prefix_caching is caching
