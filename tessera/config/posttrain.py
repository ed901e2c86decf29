"""PostTrainConfig: supervised fine-tuning on conversations, LoRA adapters and DPO (tessera.posttrain).

The flag names are Megatron-LM's where it has them (`--sft`, `--sft-tokenizer-prompt-format`;
megatron/training/arguments.py, _add_sft_args) and Megatron-Bridge's LoRA names otherwise
(`linear_qkv linear_proj linear_fc1 linear_fc2`, src/megatron/bridge/peft/lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.fields import option, positive, require

LORA = "LoRA adapters (tessera.posttrain.lora)"
DPO = "preference optimisation (tessera.posttrain.dpo)"
# The linear layers of a transformer block, by Megatron-Core's names.
LORA_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class PostTrainConfig:
    """Fine-tuning: conversations (SFT), adapters (LoRA), preference pairs (DPO)."""

    sft: bool = option(False, "supervised fine-tuning: --data-path holds conversations (JSONL with \"messages\", "
                              "or {\"prompt\", \"completion\"} rows, or their `tessera preprocess --sft` output), "
                              "packed into --seq-length rows; the loss is on assistant tokens only")
    sft_tokenizer_prompt_format: str = option(
        "default", "how conversations become tokens: the tokenizer's own chat template (default), or the turns' "
        "texts one after another (identity)", ("default", "identity"))
    lora_rank: int | None = option(None, "train low-rank adapters of this rank on the frozen model (LoRA)", group=LORA)
    lora_alpha: float | None = option(None, "LoRA's scale numerator: updates are alpha/rank x B A x "
                                            "[default: the rank, a scale of 1]", group=LORA)
    lora_dropout: float = option(0.0, "dropout on the adapters' input", group=LORA)
    lora_target_modules: list[str] = option(
        list(LORA_MODULES), "linear layers that get adapters: names or wildcards over module paths "
        "(e.g. '*.layers.0.*.linear_qkv'); MoE experts' fc1/fc2 included", group=LORA)
    lora_exclude_modules: list[str] | None = option(None, "module paths or wildcards that get no adapter",
                                                    group=LORA)
    dpo: bool = option(False, "direct preference optimisation: --data-path holds {\"prompt\", \"chosen\", "
                              "\"rejected\"} rows; the reference is the initial model", group=DPO)
    dpo_beta: float = option(0.1, "DPO's beta: the strength of the implicit KL penalty to the reference", group=DPO)
    dpo_sft_loss_weight: float = option(0.0, "add this times the chosen answers' SFT loss to DPO's", group=DPO)

    def __post_init__(self) -> None:
        positive(self, "lora_rank", "lora_alpha", "dpo_beta")
        require(0 <= self.lora_dropout < 1, "--lora-dropout must be in [0, 1)")
        require(self.dpo_sft_loss_weight >= 0, "--dpo-sft-loss-weight must be >= 0")
        require(not (self.sft and self.dpo), "--sft and --dpo are exclusive (DPO's rows are preference pairs)")
        if self.lora_rank is None:
            require(self.lora_alpha is None and self.lora_dropout == 0 and self.lora_exclude_modules is None
                    and self.lora_target_modules == list(LORA_MODULES),
                    "--lora-alpha, --lora-dropout, --lora-target-modules and --lora-exclude-modules need --lora-rank")
        elif self.lora_alpha is None:
            self.lora_alpha = float(self.lora_rank)

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None

    @property
    def lora_scale(self) -> float:
        """alpha / rank: what B A x is multiplied by."""
        return self.lora_alpha / self.lora_rank
