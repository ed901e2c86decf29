"""PostTrainConfig: supervised fine-tuning on conversations, LoRA adapters, DPO and GRPO (tessera.posttrain).

The flag names are Megatron-LM's where it has them (`--sft`, `--sft-tokenizer-prompt-format`;
megatron/training/arguments.py, _add_sft_args; `--grpo-group-size`, `--grpo-iterations`,
`--grpo-kl-beta`, _add_rl_args; `--moe-enable-routing-replay`, TransformerConfig's
moe_enable_routing_replay) and Megatron-Bridge's LoRA names otherwise
(`linear_qkv linear_proj linear_fc1 linear_fc2`, src/megatron/bridge/peft/lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.fields import option, positive, require

LORA = "LoRA adapters (tessera.posttrain.lora)"
DPO = "preference optimisation (tessera.posttrain.dpo)"
GRPO = "reinforcement learning from verifiable rewards (tessera.posttrain.grpo)"
# How the per-token losses of a global batch add up, by TRL's loss_type names (tessera.posttrain.grpo).
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
# The linear layers of a transformer block, by Megatron-Core's names.
LORA_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class PostTrainConfig:
    """Fine-tuning: conversations (SFT), adapters (LoRA), preference pairs (DPO), rewarded samples (GRPO)."""

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
    grpo: bool = option(False, "GRPO: --data-path holds {\"prompt\", \"answer\"} rows; each step samples "
                               "--grpo-group-size answers per prompt with the inference engine and rewards them",
                        group=GRPO)
    grpo_group_size: int = option(8, "answers sampled per prompt; advantages are normalised within each group",
                                  group=GRPO)
    grpo_reward: list[str] = option(["exact_match"], "rewards, summed: exact_match (the text after the last '####' "
                                    "equals the row's answer), format (--grpo-format-regex matches), or a Python "
                                    "function module:function(prompt, completion, answer) -> float", group=GRPO)
    grpo_format_regex: str = option(r"####\s*\S", "what the format reward looks for in an answer (re.search)",
                                    group=GRPO)
    grpo_max_new_tokens: int = option(256, "longest answer sampled (cut to what --seq-length leaves)", group=GRPO)
    grpo_temperature: float = option(1.0, "sampling temperature of the answers", group=GRPO)
    grpo_top_p: float = option(1.0, "nucleus sampling of the answers (1 = off)", group=GRPO)
    grpo_clip_eps: float = option(0.2, "the ratio pi / pi_old is clipped to [1 - eps, 1 + eps]", group=GRPO)
    grpo_kl_coeff: float = option(0.0, "weight of the KL penalty to the reference, the initial model (Megatron-LM's "
                                       "--grpo-kl-beta)", group=GRPO)
    grpo_iterations: int = option(1, "optimizer steps on each batch of answers (the paper's mu)", group=GRPO)
    grpo_loss_type: str = option("grpo", "how token losses add up: grpo (mean over each answer's tokens, then over "
                                 "answers), dapo (mean over the global batch's tokens), dr_grpo (sum / answers x "
                                 "--grpo-max-new-tokens)", GRPO_LOSS_TYPES, group=GRPO)
    rl_kv_cache_management_mode: str = option(
        "persist", "the inference engine's KV cache while the model trains: persist (kept, with its CUDA graphs) or "
        "recompute (freed after each rollout for training's activations, made again and its CUDA graphs captured "
        "again for the next)", ("persist", "recompute"), group=GRPO)
    moe_enable_routing_replay: bool = option(
        False, "MoE router replay: the training forward sends each token of a rollout to the experts the "
        "inference engine routed it to (the router's weights at those experts still train)", group=GRPO)

    def __post_init__(self) -> None:
        positive(self, "lora_rank", "lora_alpha", "dpo_beta", "grpo_group_size", "grpo_max_new_tokens",
                 "grpo_clip_eps", "grpo_iterations")
        require(0 <= self.lora_dropout < 1, "--lora-dropout must be in [0, 1)")
        require(self.dpo_sft_loss_weight >= 0, "--dpo-sft-loss-weight must be >= 0")
        require(not (self.sft and self.dpo), "--sft and --dpo are exclusive (DPO's rows are preference pairs)")
        require(self.grpo + self.sft + self.dpo <= 1, "--grpo does not combine with --sft or --dpo (GRPO's rows are "
                "the answers it samples)")
        require(self.grpo_temperature > 0, "--grpo-temperature must be > 0 (GRPO samples its answers)")
        require(0 < self.grpo_top_p <= 1, "--grpo-top-p must be in (0, 1]")
        require(self.grpo_kl_coeff >= 0, "--grpo-kl-coeff must be >= 0")
        require(self.grpo or self.rl_kv_cache_management_mode == "persist", "--rl-kv-cache-management-mode needs "
                "--grpo (it manages the cache of GRPO's rollouts)")
        require(self.grpo or not self.moe_enable_routing_replay, "--moe-enable-routing-replay needs --grpo (it "
                "replays the routing of GRPO's rollouts in training)")
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
