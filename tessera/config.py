"""Run configuration: one dataclass per concern, Megatron-LM flag names, validated once.

Every field is a command-line flag: field `foo_bar` is `--foo-bar`, exactly as in
Megatron-LM's `pretrain_gpt.py`, so existing launch scripts keep their flags. The same
names (with `_` or `-`) are the keys of a YAML config file. Values are layered:
dataclass defaults < `--model PRESET` < `--config run.yaml` < command-line flags.
`tessera.cli.args` turns these dataclasses into the argument parser.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad or inconsistent setting; the message names the flag(s) involved."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option(default: Any, help: str, choices: tuple | None = None, **metadata: Any) -> Any:
    """A config field with its --help text (and allowed values) for the CLI."""
    metadata = {"help": help, "choices": choices, **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value is None or value > 0, f"{flag(name)} must be positive, got {value}")


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer (GPT-2/3, LLaMA, Qwen, Mistral)."""

    num_layers: int = option(None, "number of transformer blocks", required=True)
    hidden_size: int = option(None, "width of the residual stream", required=True)
    ffn_hidden_size: int | None = option(None, "MLP inner width (default 4*hidden, or 8/3*hidden rounded down to 64 with --swiglu)")
    num_attention_heads: int = option(None, "attention heads", required=True)
    group_query_attention: bool = option(False, "use grouped-query attention (with --num-query-groups)")
    num_query_groups: int | None = option(None, "key/value heads under --group-query-attention")
    kv_channels: int | None = option(None, "head dimension (default hidden/heads)")
    seq_length: int = option(None, "training sequence length", required=True)
    max_position_embeddings: int | None = option(None, "size of the learned position table (default --seq-length)")
    vocab_size: int | None = option(None, "tokenizer vocabulary size (padded, see --make-vocab-size-divisible-by)")
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this (times the TP size)")
    position_embedding_type: str = option("learned_absolute", "position encoding", ("learned_absolute", "rope", "none"))
    rotary_base: float = option(10000.0, "RoPE base (theta)")
    rotary_percent: float = option(1.0, "fraction of each head dimension that RoPE rotates")
    normalization: str = option("LayerNorm", "normalization layer", ("LayerNorm", "RMSNorm"))
    norm_epsilon: float = option(1e-5, "epsilon of the normalization layers")
    swiglu: bool = option(False, "gated SiLU MLP (LLaMA) instead of GeLU")
    openai_gelu: bool = option(False, "tanh approximation of GeLU (GPT-2's gelu_new) instead of the exact erf form")
    disable_bias_linear: bool = option(False, "no biases in linear layers")
    add_qkv_bias: bool = option(False, "biases on the QKV projection even with --disable-bias-linear (Qwen)")
    untie_embeddings_and_output_weights: bool = option(False, "separate output layer instead of the input embedding")
    hidden_dropout: float = option(0.1, "dropout on the residual branches")
    attention_dropout: float = option(0.1, "dropout on the attention probabilities")
    init_method_std: float = option(0.02, "std of the normal initialisation (output projections are scaled by 1/sqrt(2*layers))")

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _require(getattr(self, name) is not None, f"{flag(name)} is required (or pick --model PRESET)")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size
            )
        if self.kv_channels is None:
            _require(
                self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}), or give --kv-channels",
            )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention:
            _require(
                self.num_query_groups in (None, self.num_attention_heads),
                "--num-query-groups needs --group-query-attention",
            )
            self.num_query_groups = self.num_attention_heads
        _require(self.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
                  "vocab_size", "make_vocab_size_divisible_by", "norm_epsilon", "init_method_std")
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--num-query-groups ({self.num_query_groups})",
        )
        if self.position_embedding_type == "learned_absolute":
            _require(
                self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings ({self.max_position_embeddings}) must be at least "
                f"--seq-length ({self.seq_length})",
            )
        if self.position_embedding_type == "rope":
            rotary_dim = self.kv_channels * self.rotary_percent
            _require(
                0 < self.rotary_percent <= 1 and rotary_dim == int(rotary_dim) and int(rotary_dim) % 2 == 0,
                f"--rotary-percent ({self.rotary_percent}) x --kv-channels ({self.kv_channels}) "
                "must be a positive even number of channels",
            )
        for name in ("hidden_dropout", "attention_dropout"):
            _require(0.0 <= getattr(self, name) < 1.0, f"{flag(name)} must be in [0, 1)")

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.rotary_percent)

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Vocabulary padded so that every tensor-parallel shard is a multiple of the divisor."""
        _require(self.vocab_size is not None, "--vocab-size is required (or give a tokenizer / data)")
        multiple = self.make_vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass
class ParallelConfig:
    """How the model and the batch are split over GPUs; data parallel takes what remains."""

    tensor_model_parallel_size: int = option(1, "tensor-parallel ranks (split each layer's weights)")
    pipeline_model_parallel_size: int = option(1, "pipeline stages (split the layers)")
    context_parallel_size: int = option(1, "context-parallel ranks (split the sequence in attention)")
    expert_model_parallel_size: int = option(1, "expert-parallel ranks (split MoE experts)")
    sequence_parallel: bool = option(False, "shard norms and dropout along the sequence (needs TP > 1)")
    use_distributed_optimizer: bool = option(False, "shard fp32 master weights and Adam moments over data-parallel ranks (ZeRO-1)")
    overlap_grad_reduce: bool = option(False, "reduce each gradient bucket during backward, as soon as it is ready")
    overlap_param_gather: bool = option(False, "all-gather updated parameters during the next forward (distributed optimizer)")
    use_torch_fsdp2: bool = option(False, "shard parameters, gradients and optimizer state with PyTorch FSDP2 (ZeRO-3)")
    ddp_bucket_size: int | None = option(None, "elements per gradient bucket (default max(40M, 1M x DP))")
    accumulate_allreduce_grads_in_fp32: bool = option(False, "with --bf16, reduce gradients in fp32 (default: bf16 on the wire)")
    virtual_pipeline_model_parallel_size: int | None = option(None, "model chunks per pipeline rank (interleaved 1F1B)")
    num_layers_per_virtual_pipeline_stage: int | None = option(None, "layers per model chunk (interleaved 1F1B; instead of --virtual-pipeline-model-parallel-size)")
    decoder_first_pipeline_num_layers: int | None = option(None, "layers on the first pipeline stage (the others split the rest evenly)")
    decoder_last_pipeline_num_layers: int | None = option(None, "layers on the last pipeline stage (the others split the rest evenly)")
    pipeline_schedule: str = option("1f1b", "pipeline schedule (1f1b interleaves with virtual stages)", ("1f1b", "gpipe"))
    print_schedule: bool = option(
        False, "print every pipeline rank's schedule and exit (without torchrun: WORLD_SIZE=N tessera train ...)")

    def __post_init__(self) -> None:
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "expert_model_parallel_size", "ddp_bucket_size")
        _require(not (self.use_distributed_optimizer and self.use_torch_fsdp2),
                 "--use-distributed-optimizer and --use-torch-fsdp2 are exclusive (FSDP2 already shards the optimizer)")
        _require(not self.overlap_param_gather or self.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer")
        _positive(self, "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        _require(self.virtual_pipeline_model_parallel_size is None or self.num_layers_per_virtual_pipeline_stage is None,
                 "give --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage, not both")
        pipeline_flags = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                          "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        for name in pipeline_flags:
            _require(getattr(self, name) is None or self.pipeline_model_parallel_size > 1,
                     f"{flag(name)} needs --pipeline-model-parallel-size > 1")
        _require(not (self.use_torch_fsdp2 and self.pipeline_model_parallel_size > 1),
                 "--use-torch-fsdp2 with --pipeline-model-parallel-size > 1 is not supported")

    def virtual_pipeline_size(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        per_chunk = self.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return self.virtual_pipeline_model_parallel_size or 1
        pp = self.pipeline_model_parallel_size
        _require(num_layers % (pp * per_chunk) == 0,
                 f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
                 f"--num-layers-per-virtual-pipeline-stage ({per_chunk})")
        return num_layers // (pp * per_chunk)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        _require(
            world_size % self.model_parallel_size == 0,
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size "
            f"({self.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
            f"({self.pipeline_model_parallel_size}) x --context-parallel-size ({self.context_parallel_size})",
        )
        return world_size // self.model_parallel_size


@dataclass
class DataConfig:
    """Where training samples come from."""

    TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                       "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "ByteTokenizer",
                       "NullTokenizer")

    mock_data: bool = option(False, "train on deterministic synthetic tokens instead of a dataset")
    num_workers: int = option(2, "DataLoader worker processes")
    data_path: list[str] | None = option(None, "dataset prefixes (.bin/.idx without extension): "
                                         "PREFIX, or P1 P2 ... (weighted by size), or W1 P1 W2 P2 ...")
    split: str = option("969, 30, 1", "train, valid, test proportions of each --data-path dataset")
    train_data_path: list[str] | None = option(None, "training dataset(s), whole (instead of --data-path and --split)")
    valid_data_path: list[str] | None = option(None, "validation dataset(s), whole")
    test_data_path: list[str] | None = option(None, "test dataset(s), whole")
    data_cache_path: str | None = option(None, "directory for the sample index cache (default: next to each dataset)")
    mid_level_dataset_surplus: float = option(0.005, "extra fraction of samples each blended dataset builds")
    reset_position_ids: bool = option(False, "restart position ids after each end-of-document token")
    reset_attention_mask: bool = option(False, "no attention across end-of-document tokens")
    eod_mask_loss: bool = option(False, "no loss on the token that follows an end-of-document token")
    tokenizer_type: str | None = option(None, "tokenizer (loaded from local files)", TOKENIZER_TYPES)
    tokenizer_model: str | None = option(None, "tokenizer file: tokenizer.json (or its directory), .model, BPE file")
    vocab_file: str | None = option(None, "GPT-2 vocab.json (GPT2BPETokenizer)")
    merge_file: str | None = option(None, "GPT-2 merges.txt (GPT2BPETokenizer)")
    tiktoken_pattern: str = option("v2", "TikTokenizer pre-tokenization pattern", ("v1", "v2"))
    tiktoken_num_special_tokens: int = option(1000, "TikTokenizer ids reserved for special tokens")

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, "--num-workers must be >= 0")
        self.split_fractions()
        per_split = (self.train_data_path, self.valid_data_path, self.test_data_path)
        _require(self.data_path is None or all(p is None for p in per_split),
                 "give --data-path or --train-data-path/--valid-data-path/--test-data-path, not both")
        _require(self.mid_level_dataset_surplus >= 0, "--mid-level-dataset-surplus must be >= 0")

    def split_fractions(self) -> list[float]:
        """--split as three fractions summing to 1 (missing entries are 0), Megatron's parsing."""
        import re

        numbers = [float(x) for x in re.findall(r"[-+]?(?:\d*\.\d+|\d+\.?)", self.split)]
        _require(0 < len(numbers) <= 3 and all(x >= 0 for x in numbers) and sum(numbers) > 0,
                 f"--split must be up to three non-negative numbers with a positive sum, got '{self.split}'")
        numbers += [0.0] * (3 - len(numbers))
        return [x / sum(numbers) for x in numbers]


@dataclass
class OptimConfig:
    """AdamW, learning-rate schedule and gradient clipping."""

    optimizer: str = option("adam", "optimizer (AdamW semantics)", ("adam",))
    lr: float = option(None, "peak learning rate", required=True)
    min_lr: float = option(0.0, "learning rate at the end of decay")
    lr_decay_style: str = option("linear", "learning-rate decay", ("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_decay_iters: int | None = option(None, "iterations over which to decay (default --train-iters)")
    lr_warmup_iters: int = option(0, "linear warmup iterations")
    lr_warmup_fraction: float | None = option(None, "warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    lr_warmup_init: float = option(0.0, "learning rate at the start of warmup")
    lr_wsd_decay_style: str = option("exponential", "shape of the WSD decay phase", ("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: int | None = option(None, "length of the WSD decay phase at the end of --lr-decay-iters")
    weight_decay: float = option(0.01, "decoupled weight decay (not applied to norms and biases)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0 disables)")

    def __post_init__(self) -> None:
        _require(self.lr is not None, "--lr is required")
        _require(self.lr >= 0 and self.min_lr >= 0, "--lr and --min-lr must be >= 0")
        _require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        _require(self.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
        if self.lr_warmup_fraction is not None:
            _require(self.lr_warmup_iters == 0, "give --lr-warmup-fraction or --lr-warmup-iters, not both")
            _require(0 <= self.lr_warmup_fraction <= 1, "--lr-warmup-fraction must be in [0, 1]")
        for name in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, name) < 1, f"{flag(name)} must be in [0, 1)")
        _positive(self, "adam_eps", "lr_decay_iters", "lr_wsd_decay_iters")
        _require(self.weight_decay >= 0 and self.clip_grad >= 0, "--weight-decay and --clip-grad must be >= 0")
        if self.lr_decay_style == "WSD":
            _require(self.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters")


@dataclass
class TrainConfig:
    """Batch, length of the run, precision, recompute, logging."""

    micro_batch_size: int = option(1, "sequences per micro-batch per data-parallel rank")
    global_batch_size: int | None = option(None, "sequences per iteration over all ranks (default micro x DP)")
    train_iters: int = option(None, "iterations to train", required=True)
    seed: int = option(1234, "random seed (initialisation, dropout, data order)")
    bf16: bool = option(False, "bf16 mixed precision (fp32 master weights)")
    fp16: bool = option(False, "fp16 mixed precision with loss scaling")
    loss_scale: float | None = option(None, "static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = option(2.0**32, "first dynamic loss scale")
    min_loss_scale: float = option(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = option(1000, "iterations without overflow before the scale doubles")
    hysteresis: int = option(2, "overflows tolerated before the scale halves")
    recompute_granularity: str | None = option(None, "activation recomputation", ("full", "selective"))
    recompute_method: str | None = option(None, "which layers --recompute-granularity full recomputes", ("uniform", "block"))
    recompute_num_layers: int | None = option(None, "layers per recompute chunk (uniform) or recomputed layers (block)")
    attention_backend: str = option("auto", "SDPA kernel preference", ("auto", "flash", "cudnn", "efficient", "math"))
    compile: bool | None = option(None, "torch.compile each block (default: on for CUDA, off on CPU)")
    device: str = option("auto", "where to train", ("auto", "cpu", "cuda"))
    log_interval: int = option(10, "iterations between log lines")
    log_json: str | None = option(None, "append one JSON object per logged iteration to this file")
    tensorboard_dir: str | None = option(None, "write TensorBoard scalars here")
    eval_interval: int | None = option(None, "iterations between evaluations (default: never)")
    eval_iters: int = option(10, "batches per evaluation")
    exit_interval: int | None = option(None, "stop after the iteration divisible by this")
    exit_duration_in_mins: float | None = option(None, "stop (saving a checkpoint with --save) after this many minutes")
    exit_signal_handler: bool = option(False, "on SIGTERM, save a checkpoint at the end of the iteration and exit 0")
    check_for_nan_in_loss_and_grad: bool | None = option(
        None, "stop before applying an update whose loss or gradients hold NaN/Inf [default: on]")
    peak_tflops: float | None = option(None, "GPU peak TFLOP/s for MFU (default: detected from the device name)")

    def __post_init__(self) -> None:
        _require(self.train_iters is not None, "--train-iters is required")
        _positive(self, "micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                  "eval_interval", "eval_iters", "exit_interval", "loss_scale_window", "hysteresis",
                  "peak_tflops", "loss_scale", "initial_loss_scale", "min_loss_scale")
        _require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are exclusive")
        _positive(self, "exit_duration_in_mins")
        if self.check_for_nan_in_loss_and_grad is None:
            self.check_for_nan_in_loss_and_grad = True
        if self.recompute_granularity == "full":
            _require(self.recompute_method is not None, "--recompute-granularity full needs --recompute-method")
            _require(self.recompute_num_layers is not None and self.recompute_num_layers > 0,
                     "--recompute-granularity full needs a positive --recompute-num-layers")
        else:
            _require(self.recompute_method is None,
                     "--recompute-method needs --recompute-granularity full")

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class CheckpointConfig:
    """Saving and resuming (tessera.training.checkpoint)."""

    save: str | None = option(None, "directory to save checkpoints to")
    save_interval: int | None = option(None, "iterations between checkpoints (and one at the end of the run)")
    load: str | None = option(None, "directory to resume from (its newest complete checkpoint)")
    no_load_optim: bool = option(False, "do not load the optimizer state (Adam moments) from --load")
    no_load_rng: bool = option(False, "do not load the random-number-generator states from --load")
    finetune: bool = option(False, "load only the weights from --load and start at iteration 0")
    async_save: bool = option(False, "write checkpoints in the background while training continues")
    keep_last: int | None = option(None, "keep only this many newest checkpoints in --save")

    def __post_init__(self) -> None:
        _positive(self, "save_interval", "keep_last")
        _require(self.save_interval is None or self.save is not None, "--save-interval needs --save")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class RunConfig:
    """Everything a training run needs; cross-section checks happen here."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(train_iters=1))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    world_size: int = 1

    def __post_init__(self) -> None:
        model, parallel, train = self.model, self.parallel, self.train
        dp = parallel.data_parallel_size(self.world_size)
        per_step = train.micro_batch_size * dp
        if train.global_batch_size is None:
            train.global_batch_size = per_step
        _require(
            train.global_batch_size % per_step == 0,
            f"--global-batch-size ({train.global_batch_size}) must be divisible by --micro-batch-size "
            f"({train.micro_batch_size}) x data-parallel size ({dp}) = {per_step}",
        )
        tp = parallel.tensor_model_parallel_size
        _require(parallel.sequence_parallel is False or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
        _require(
            model.num_attention_heads % tp == 0,
            f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})",
        )
        parallel.virtual_pipeline_size(model.num_layers)  # checks --num-layers-per-virtual-pipeline-stage
        if train.recompute_granularity == "full" and train.recompute_method == "uniform":
            _require(
                model.num_layers % train.recompute_num_layers == 0,
                f"--recompute-num-layers ({train.recompute_num_layers}) must divide --num-layers "
                f"({model.num_layers}) with --recompute-method uniform",
            )

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)

    @property
    def num_micro_batches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
