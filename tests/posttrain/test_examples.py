"""examples/sft.py end to end in its --quick setting: SFT, LoRA on the SFT model, DPO on a weaker one.

A few steps teach no sorting, so accuracies are not compared; what the steps do teach is checked.
"""

import json

import pytest

from examples import sft


def answers(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("sft-demo")
    sft.main(["--quick", "--work", str(work)])
    return work


def test_sft_teaches_the_base_model_to_end_its_answers(work):
    before, after = answers(work / "sort_heldout_base.jsonl"), answers(work / "sort_heldout_sft.jsonl")
    assert len(before) == len(after) == 8
    # The random base runs to the token limit; after SFT each answer ends with the end of turn,
    # which is trained with the answers (a loss mask without it would not teach this).
    assert {row["finish_reason"] for row in before} == {"length"}
    assert {row["finish_reason"] for row in after} == {"stop"}


def test_lora_trains_adapters_that_peft_loads_and_answers_with(work):
    result = sft.main(["--lora", "--quick", "--work", str(work)])
    assert (work / "lora-adapter" / "adapter_model.safetensors").exists()
    # transformers + PEFT on the export answer as tessera answers with the LoRA checkpoint.
    assert result["peft_answer"] == answers(work / "desc_heldout_lora.jsonl")[0]["completion"]


def test_dpo_trains_on_preference_pairs_from_the_sft_model(work):
    result = sft.main(["--dpo", "--quick", "--work", str(work)])
    assert 0 <= result["before"] <= 1 and 0 <= result["after"] <= 1
    assert len(answers(work / "sort_heldout_dpo.jsonl")) == 8
    # Each pair rejects the weak model's own wrong answer to its prompt.
    weak = {row["messages"][0]["content"]: row["completion"] for row in answers(work / "sort_prompts_sft-weak.jsonl")}
    pairs = answers(work / "sort_preferences.jsonl")
    assert pairs and all(pair["rejected"] == weak[pair["prompt"]] != pair["chosen"] for pair in pairs)
