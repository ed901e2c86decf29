"""The sections of a run beside the model: optimizer, training loop, checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.fields import flag, option, positive, require

# The modules whose saved activations --offload-modules names (tessera.models.activation_offload):
# Megatron-LM's names, and `mlp` for the dense MLP.
ACTIVATION_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp",
                              "expert_fc1", "moe_act")

MUON = "Muon (--optimizer muon)"

@dataclass
class OptimConfig:
    """Optimizer (AdamW, SGD, Muon), learning-rate schedule and gradient clipping."""

    optimizer: str = option("adam", "adam: AdamW; sgd: SGD with momentum; muon: Muon for the hidden layers' matrices "
                            "and AdamW for the rest (docs/optimizers.md)", ("adam", "sgd", "muon"))
    lr: float = option(None, "peak learning rate", required=True)
    min_lr: float = option(0.0, "learning rate at the end of decay")
    lr_decay_style: str = option("linear", "learning-rate decay", ("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_decay_iters: int | None = option(None, "iterations over which to decay (default --train-iters)")
    lr_warmup_iters: int = option(0, "linear warmup iterations")
    lr_warmup_fraction: float | None = option(None, "warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    lr_warmup_init: float = option(0.0, "learning rate at the start of warmup")
    lr_wsd_decay_style: str = option("exponential", "shape of the WSD decay phase", ("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: int | None = option(None, "length of the WSD decay phase at the end of --lr-decay-iters")
    decoupled_lr: float | None = option(None, "peak learning rate of the word embedding and the output layer (the "
                                        "others train at --lr; the same schedule)")
    decoupled_min_lr: float | None = option(None, "with --decoupled-lr: their learning rate at the end of decay "
                                            "(default --min-lr)")
    lr_decay_samples: int | None = option(None, "with --train-samples: samples over which to decay (default "
                                          "--train-samples)")
    lr_warmup_samples: int = option(0, "with --train-samples: linear warmup samples")
    lr_wsd_decay_samples: int | None = option(None, "with --train-samples: samples of the WSD decay phase")
    weight_decay: float = option(0.01, "decoupled weight decay (not applied to norms and biases)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.9, "--optimizer sgd: momentum factor")
    muon_momentum: float = option(0.9, "--optimizer muon: momentum (an average of the gradients: B <- m B + (1 - m) G)",
                                  group=MUON)
    muon_nesterov: bool = option(False, "Nesterov momentum in Muon", group=MUON)
    muon_no_split_qkv: bool = option(False, "orthogonalise the fused QKV weight whole, not as its Q, K and V",
                                     group=MUON)
    muon_num_ns_steps: int = option(5, "Newton-Schulz iterations per step", group=MUON)
    muon_coefficient_type: str = option("quintic", "Newton-Schulz coefficients: simple (torch.optim.Muon's), quintic "
                                        "(tuned per step; steps a multiple of 5), polar_express (at least 8 steps)",
                                        ("simple", "quintic", "polar_express"), group=MUON)
    muon_fp32_matmul_prec: str = option("medium", "Newton-Schulz maths: medium bf16, high fp32 with TF32 tensor "
                                        "cores, highest fp32", ("medium", "high", "highest"), group=MUON)
    muon_scale_mode: str = option("spectral", "scale of the orthogonalised update: spectral sqrt(max(m, n)), "
                                  "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n))",
                                  ("spectral", "unit_rms_norm", "shape_scaling"), group=MUON)
    muon_extra_scale_factor: float = option(1.0, "extra factor on Muon's update (0.2 with spectral: Moonlight's match "
                                            "of AdamW's update RMS, so AdamW's --lr and --weight-decay carry over)",
                                            group=MUON)
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0 disables)")
    use_precision_aware_optimizer: bool = option(False, "keep the fp32 masters as remainders below the bf16 "
                                                 "weights, and let --exp-avg-dtype / --exp-avg-sq-dtype set the "
                                                 "Adam moments' dtype (with --use-distributed-optimizer)")
    exp_avg_dtype: str = option("fp32", "dtype of Adam's first moment (bf16: rounded from fp32 maths each step)",
                                ("fp32", "bf16"))
    exp_avg_sq_dtype: str = option("fp32", "dtype of Adam's second moment", ("fp32", "bf16"))
    optimizer_cpu_offload: bool = option(False, "keep the distributed optimizer's fp32 masters and Adam moments in "
                                         "host memory, streamed through the GPU for each step (docs/optimizers.md)")
    optimizer_offload_fraction: float = option(1.0, "with --optimizer-cpu-offload: the share of the optimizer state "
                                               "kept in host memory (by elements, the first in the gradient buffers)")

    def __post_init__(self) -> None:
        require(self.lr is not None, "--lr is required")
        require(self.use_precision_aware_optimizer or (self.exp_avg_dtype, self.exp_avg_sq_dtype) == ("fp32", "fp32"),
                "--exp-avg-dtype and --exp-avg-sq-dtype need --use-precision-aware-optimizer")
        require(self.lr >= 0 and self.min_lr >= 0, "--lr and --min-lr must be >= 0")
        require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        require(self.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0")
        if self.lr_warmup_fraction is not None:
            require(self.lr_warmup_iters == 0, "give --lr-warmup-fraction or --lr-warmup-iters, not both")
            require(0 <= self.lr_warmup_fraction <= 1, "--lr-warmup-fraction must be in [0, 1]")
        for name in ("adam_beta1", "adam_beta2"):
            require(0 <= getattr(self, name) < 1, f"{flag(name)} must be in [0, 1)")
        positive(self, "adam_eps", "lr_decay_iters", "lr_wsd_decay_iters")
        require(self.weight_decay >= 0 and self.clip_grad >= 0, "--weight-decay and --clip-grad must be >= 0")
        self._check_momentum()
        require(0 <= self.optimizer_offload_fraction <= 1, "--optimizer-offload-fraction must be in [0, 1]")
        positive(self, "lr_decay_samples", "lr_wsd_decay_samples")
        require(self.decoupled_min_lr is None or self.decoupled_lr is not None,
                "--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_lr is not None:
            decoupled_min = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            require(0 <= decoupled_min <= self.decoupled_lr,
                    f"--decoupled-min-lr ({decoupled_min}) must be in [0, --decoupled-lr ({self.decoupled_lr})]")
        require(self.lr_warmup_samples >= 0, "--lr-warmup-samples must be >= 0")
        require(not (self.lr_warmup_samples and self.lr_warmup_fraction is not None),
                "give --lr-warmup-fraction or --lr-warmup-samples, not both")
        if self.lr_decay_style == "WSD":
            require(self.lr_wsd_decay_iters is not None or self.lr_wsd_decay_samples is not None,
                    "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")

    def _check_momentum(self) -> None:
        for name in ("sgd_momentum", "muon_momentum"):
            require(0 <= getattr(self, name) < 1, f"{flag(name)} must be in [0, 1)")
        positive(self, "muon_num_ns_steps", "muon_extra_scale_factor")

    def check_schedule_units(self, sample_based: bool) -> None:
        """As Megatron-LM: a run counts its schedule in samples (--train-samples) or in iterations."""
        for unit in ("decay", "warmup", "wsd_decay"):
            iters, samples = f"lr_{unit}_iters", f"lr_{unit}_samples"
            wrong, right = (iters, samples) if sample_based else (samples, iters)
            require(not getattr(self, wrong), f"{flag(wrong)} does not go with "
                    f"{'--train-samples' if sample_based else '--train-iters'}: give {flag(right)}")


FP8 = "FP8 training (tessera.training.fp8)"
# Megatron-LM's --attention-backend values (megatron/core/transformer/enums.py, AttnBackend) and the
# SDPA kernel each one is: Transformer Engine's fused attention is cuDNN's; unfused and local are the
# plain softmax(QK^T)V.
MEGATRON_ATTENTION_BACKENDS = {"fused": "cudnn", "unfused": "math", "local": "math"}


@dataclass
class TrainConfig:
    """Batch, length of the run, precision, recompute, logging."""

    micro_batch_size: int = option(1, "sequences per micro-batch per data-parallel rank")
    global_batch_size: int | None = option(None, "sequences per iteration over all ranks (default micro x DP)")
    train_iters: int | None = option(None, "iterations to train (or give --train-samples)")
    train_samples: int | None = option(None, "samples to train, instead of --train-iters: as many iterations as "
                                       "whole global batches fit (Megatron-LM's sample-based training)")
    seed: int = option(1234, "random seed (initialisation, dropout, data order)")
    bf16: bool = option(False, "bf16 mixed precision (fp32 master weights)")
    fp16: bool = option(False, "fp16 mixed precision with loss scaling")
    loss_scale: float | None = option(None, "static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = option(2.0**32, "first dynamic loss scale")
    min_loss_scale: float = option(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = option(1000, "iterations without overflow before the scale doubles")
    hysteresis: int = option(2, "overflows tolerated before the scale halves")
    fp8_format: str | None = option(None, "FP8 GEMMs in the transformer layers' linears: e4m3 everywhere, or hybrid "
                                    "(E5M2 gradients); needs --bf16 and an FP8 GPU", ("e4m3", "hybrid"), group=FP8)
    fp8_recipe: str = option("delayed", "FP8 scaling: per tensor from this step's amax (tensorwise) or from the "
                             "amax history (delayed), or per 1x128 tile / 128x128 weight block (blockwise, "
                             "DeepSeek-V3's; e4m3, Hopper)", ("tensorwise", "delayed", "blockwise", "mxfp8"), group=FP8)
    fp8_margin: int = option(0, "delayed scaling: scale down by 2^margin for headroom", group=FP8)
    fp8_amax_history_len: int = option(1, "delayed scaling: steps of amax history", group=FP8)
    fp8_amax_compute_algo: str = option("most_recent", "delayed scaling: the amax a scale comes from",
                                        ("most_recent", "max"), group=FP8)
    first_last_layers_bf16: bool = option(False, "keep the first and last transformer layers in bf16", group=FP8)
    num_layers_at_start_in_bf16: int = option(1, "with --first-last-layers-bf16: layers at the start", group=FP8)
    num_layers_at_end_in_bf16: int = option(1, "with --first-last-layers-bf16: layers at the end", group=FP8)
    no_fp8_wgrad: bool = option(False, "compute the weight gradients in bf16, not FP8", group=FP8)
    fp8_experts: bool = option(False, "the MoE experts' grouped GEMMs in FP8 too, scaled per row: faster for "
                               "coarse experts, slower for fine-grained ones (docs/moe.md)", group=FP8)
    fp8_param_gather: bool = option(False, "the distributed optimizer or FSDP2 all-gathers the FP8 linears' weights "
                                    "in FP8 (half the bytes) and the layers read them instead of casting", group=FP8)
    recompute_granularity: str | None = option(None, "activation recomputation", ("full", "selective"))
    recompute_method: str | None = option(None, "which layers --recompute-granularity full recomputes", ("uniform", "block"))
    recompute_num_layers: int | None = option(None, "layers per recompute chunk (uniform) or recomputed layers (block)")
    fine_grained_activation_offloading: bool = option(
        False, "copy what the --offload-modules save for backward to host memory in the forward pass, and back "
        "before their backward (tessera.models.activation_offload; the blocks run uncompiled)")
    offload_modules: list[str] = option(
        [], "with --fine-grained-activation-offloading: the modules whose saved activations go to host memory",
        ACTIVATION_OFFLOAD_MODULES)
    min_offloaded_tensor_size: int = option(1024 * 1024, "saved tensors with fewer elements stay on the GPU")
    attention_backend: str = option(
        "auto", "SDPA kernel preference; Megatron-LM's names are taken too (fused: cudnn; unfused, local: math)",
        ("auto", "flash", "cudnn", "efficient", "math") + tuple(MEGATRON_ATTENTION_BACKENDS))
    compile: bool | None = option(None, "torch.compile each block (default: on for CUDA, off on CPU)")
    compile_artifacts: bool | None = option(
        None, "save torch.compile's artifacts with each checkpoint and load them with it, so that a restart on a "
        "fresh machine starts warm (default: on whenever the blocks are compiled; torch >= 2.7)")
    cuda_graph_impl: str = option("none", "full_iteration: replay each step's forward and backward passes as one "
                                  "CUDA graph (the optimizer step stays eager; one GPU)", ("none", "full_iteration"))
    cuda_graph_warmup_steps: int = option(3, "eager steps before --cuda-graph-impl captures (compilation settles)")
    device: str = option("auto", "where to train", ("auto", "cpu", "cuda"))
    log_interval: int = option(10, "iterations between log lines")
    log_straggler: bool = option(
        False, "every --log-interval, name the ranks whose forward-backward is slowest and fastest")
    straggler_minmax_count: int = option(1, "how many slowest and fastest ranks --log-straggler names")
    log_json: str | None = option(None, "append one JSON object per logged iteration to this file", per_node=True)
    moe_per_layer_logging: bool = option(False, "log each MoE layer's load-balancing losses and load imbalance")
    tensorboard_dir: str | None = option(None, "write TensorBoard scalars here", per_node=True)
    eval_interval: int | None = option(None, "iterations between evaluations (default: never)")
    eval_iters: int = option(10, "batches per evaluation")
    exit_interval: int | None = option(None, "stop after the iteration divisible by this")
    exit_duration_in_mins: float | None = option(None, "stop (saving a checkpoint with --save) after this many minutes")
    exit_signal_handler: bool = option(False, "on SIGTERM, save a checkpoint at the end of the iteration and exit 0")
    check_for_nan_in_loss_and_grad: bool | None = option(
        None, "stop before applying an update whose loss or gradients hold NaN/Inf [default: on]")
    peak_tflops: float | None = option(None, "GPU peak TFLOP/s for MFU (default: detected from the device name)")

    def __post_init__(self) -> None:
        require(self.train_iters is not None or self.train_samples is not None, "--train-iters is required "
                "(or --train-samples)")
        positive(self, "micro_batch_size", "global_batch_size", "train_iters", "train_samples", "log_interval",
                  "eval_interval", "eval_iters", "exit_interval", "loss_scale_window", "hysteresis",
                  "peak_tflops", "loss_scale", "initial_loss_scale", "min_loss_scale", "straggler_minmax_count")
        require(self.cuda_graph_warmup_steps >= 0, "--cuda-graph-warmup-steps must be >= 0")
        require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are exclusive")
        self.attention_backend = MEGATRON_ATTENTION_BACKENDS.get(self.attention_backend, self.attention_backend)
        self._check_fp8()
        positive(self, "exit_duration_in_mins")
        if self.check_for_nan_in_loss_and_grad is None:
            self.check_for_nan_in_loss_and_grad = True
        if self.recompute_granularity == "full":
            require(self.recompute_method is not None, "--recompute-granularity full needs --recompute-method")
            require(self.recompute_num_layers is not None and self.recompute_num_layers > 0,
                     "--recompute-granularity full needs a positive --recompute-num-layers")
        else:
            require(self.recompute_method is None,
                     "--recompute-method needs --recompute-granularity full")
        self._check_activation_offload()

    def _check_activation_offload(self) -> None:
        """What fine-grained activation offloading takes (tessera.models.activation_offload)."""
        require(bool(self.offload_modules) == self.fine_grained_activation_offloading,
                "--fine-grained-activation-offloading and --offload-modules go together")
        unknown = sorted(set(self.offload_modules) - set(ACTIVATION_OFFLOAD_MODULES))
        require(not unknown, f"--offload-modules: unknown {', '.join(unknown)} (choose from "
                f"{', '.join(ACTIVATION_OFFLOAD_MODULES)})")
        require(self.min_offloaded_tensor_size >= 0, "--min-offloaded-tensor-size must be >= 0")
        if not self.fine_grained_activation_offloading:
            return
        require(not (self.recompute_granularity == "selective" and "core_attn" in self.offload_modules),
                "--offload-modules core_attn does not combine with --recompute-granularity selective (core "
                "attention is recomputed: it saves nothing to offload)")
        require(not (self.recompute_granularity == "full" and self.recompute_method == "uniform"),
                "--fine-grained-activation-offloading does not combine with --recompute-method uniform (every "
                "layer is recomputed and saves only its input); use --recompute-method block")
        require(self.cuda_graph_impl == "none", "--fine-grained-activation-offloading does not combine with "
                "--cuda-graph-impl (its copies are issued from the host)")
        # A compiled block saves its tensors in one autograd function: no module boundaries inside.
        require(self.compile is not True, "--fine-grained-activation-offloading does not combine with --compile "
                "(its hooks mark module boundaries that a compiled block hides)")
        self.compile = False

    def _check_fp8(self) -> None:
        if self.fp8_format is None:
            require(not self.fp8_experts, "--fp8-experts needs --fp8-format")
            require(not self.fp8_param_gather, "--fp8-param-gather needs --fp8-format")
            return
        require(self.bf16, "--fp8-format needs --bf16 (the FP8 GEMMs read and return bf16)")
        require(self.fp8_recipe != "mxfp8", "--fp8-recipe mxfp8 needs a Blackwell GPU (MXFP8 tensor cores); "
                "use tensorwise, delayed or blockwise on Hopper")
        require(self.fp8_recipe != "blockwise" or self.fp8_format == "e4m3",
                "--fp8-recipe blockwise needs --fp8-format e4m3 (cuBLAS's block-scaled GEMMs take E4M3 operands only)")
        require(not (self.first_last_layers_bf16 and self.fp8_recipe == "delayed"),
                "--first-last-layers-bf16 does not combine with --fp8-recipe delayed (as in Megatron)")
        require(self.fp8_margin >= 0 and self.num_layers_at_start_in_bf16 >= 0 and self.num_layers_at_end_in_bf16 >= 0,
                "--fp8-margin and --num-layers-at-start/end-in-bf16 must be >= 0")
        positive(self, "fp8_amax_history_len")

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
    use_checkpoint_args: bool = option(
        False, "take the model's flags from the checkpoint in --load (or --pretrained-checkpoint, a Hugging Face "
        "directory too); flags that may change on resume (--seq-length, dropout, ...) still come from the command "
        "line. Done by itself when no model is given at all")
    pretrained_checkpoint: str | None = option(
        None, "the weights to start from when --load holds no checkpoint: a tessera checkpoint or a Hugging Face "
        "model directory (converted as it loads); iteration 0, a fresh optimizer (fine-tuning)")
    async_save: bool = option(False, "write checkpoints in the background while training continues")
    keep_last: int | None = option(None, "keep only this many newest checkpoints in --save")

    def __post_init__(self) -> None:
        positive(self, "save_interval", "keep_last")
        require(self.save_interval is None or self.save is not None, "--save-interval needs --save")
