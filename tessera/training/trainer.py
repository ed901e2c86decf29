"""The training loop: micro-batches accumulated into a global batch, one optimizer step each.

The trainer runs the loop over what tessera.training.build makes (this rank's device, model and
pipeline stage), with the data, the optimizer, the objective, precision and metrics. One iteration:

    for each micro-batch: forward -> per-token loss -> backward of (masked loss sum / global tokens)
    gradients reduced over data-parallel ranks (during the last backward with --overlap-grad-reduce)
    global grad norm -> AdamW step, unscaled, clipped and skipped on overflow inside the fused kernel

(With --cuda-graph-impl full_iteration the micro-batches' forward and backward passes replay
as one CUDA graph: tessera.training.cuda_graph.)

Each rank divides its loss by the number of unmasked tokens in the whole global batch, so
summing gradients over ranks gives the mean over tokens exactly once, and neither the
micro-batch split nor the number of data-parallel ranks changes the maths. Under context
parallelism each rank holds its chunks of every sample (cut in tessera.training.batches.place_batch) and counts
their tokens: the same sum, over the data x context group.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tessera.config import ConfigError, RunConfig
from tessera.models.documents import default_backend
from tessera.models.gpt import GPTModel
from tessera.parallel.mesh import Mesh
from tessera.parallel.pipeline import PipelineRunner
from tessera.perf.flops import flops_per_iteration
from tessera.training import fp8
from tessera.training.batches import Batch, DataSource, place_batch
from tessera.training.build import PipelineStage, activation_dtype, build_model, join_job, stage_chunks
from tessera.training.checkpoint import Checkpointer
from tessera.training.cuda_graph import StepGraph
from tessera.training.losses import LossTerms, MoEBalance
from tessera.training.nan_check import NonFiniteCheck
from tessera.training.metrics import IterationStats, MetricsWriter, peak_memory_gb, resolve_peak_tflops
from tessera.training.optimizer import build_optimizer
from tessera.training.precision import LossScaler, autocast, autocast_dtype
from tessera.training.run_summary import run_summary
from tessera.training.schedules import LRSchedule
from tessera.training.startup import Startup
from tessera.training.stragglers import StragglerTimer

@dataclass
class StepResult:
    """One iteration's outcome. Fields are 0-d device tensors until `resolve()`, so that a
    step never waits for the GPU; the log reads them once per --log-interval."""

    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    skipped: torch.Tensor | bool
    moe: dict[str, torch.Tensor | float] = field(default_factory=dict)   # MoE losses and load, by name
    terms: dict[str, torch.Tensor | float] = field(default_factory=dict)   # MTP depths' losses, DPO's rewards, by name

    def resolve(self) -> "StepResult":
        loss, norm, skipped, *extra = torch.stack([self.loss, self.grad_norm, self.skipped.float(),
                                                   *self.moe.values(), *self.terms.values()]).tolist()
        moe, terms = extra[:len(self.moe)], extra[len(self.moe):]
        return StepResult(loss, norm, bool(skipped), dict(zip(self.moe, moe)), dict(zip(self.terms, terms)))


class Trainer:
    def __init__(self, config: RunConfig):
        self.config, train = config, config.train
        self.startup = Startup()
        self.device = join_job(config)
        self.mesh = Mesh.build(config.parallel, self.device.type)
        self.data = DataSource(config, self.mesh)
        chunks = stage_chunks(config, self.mesh)
        built = build_model(config, self.mesh, self.device, chunks)
        self.model, self.context_parallel, self.fp8_layers, self.compiled = \
            built.model, built.context_parallel, built.fp8_layers, built.compiled
        self.moe = MoEBalance(self.model, self.mesh, num_micro_batches=config.num_micro_batches,
                              bias_update_rate=config.model.moe_router_bias_update_rate,
                              per_layer=train.moe_per_layer_logging)
        self.losses = self._objective()
        groups = PipelineStage.groups_of(config, self.mesh)
        self.optimizer = build_optimizer(self.model, config.optim, config.parallel, self.mesh, bf16=train.bf16,
                                         pipeline=groups, micro_batches=config.num_micro_batches,
                                         fp8_gathered=fp8.gathered_weights(self.model) if train.fp8_param_gather else None)
        self.pipeline = None if groups is None else PipelineStage.build(
            config, self.mesh, chunks, groups, activation_dtype(self.model), self.device)
        self.lr_schedule, self.loss_scaler = LRSchedule(config.optim, train), LossScaler(train)
        self.amp_dtype = autocast_dtype(train)
        self.iteration = self.consumed_samples = self.skipped_iterations = self.nan_iterations = 0
        self._kernels()
        self.checkpointer = Checkpointer(config, self.device)
        self.startup.lap("build")
        self._start_weights()
        self.startup.lap("load")
        self.train_data = self._train_data()
        self.valid_data = self.data.micro_batches("valid", consumed_samples=0) if train.eval_interval else None
        self._monitors()

    def _kernels(self) -> None:
        """The step's kernel choices: packed samples' attention, SDPA's order, the CUDA graph."""
        self.document_backend = default_backend(self.device, self.amp_dtype or torch.float32,
                                                self.config.model.attention_dropout > 0)
        self._attention = _attention_backend(self.config.train.attention_backend, self.device)
        self.step_graph = self._step_graph()

    def _start_weights(self) -> None:
        """The model, optimizer, iteration, consumed samples and RNG of a resume, or the start
        weights; and DPO's reference without LoRA: the start weights' log-probs of every row,
        before a resume replaces those weights (with LoRA it is the model with its adapters off)."""
        config, post = self.config, self.config.posttrain
        reference_pass = self._reference_pass if post.dpo and not post.lora else None
        self.initial_model = None   # GRPO's KL reference without LoRA: a frozen copy of the start weights
        if post.grpo and post.grpo_kl_coeff and not post.lora:
            reference_pass = self._keep_initial_model
        if config.checkpoint.load or config.checkpoint.pretrained_checkpoint:
            self.checkpointer.load(self, on_start_weights=reference_pass)
        elif reference_pass is not None:
            reference_pass()

    def _monitors(self) -> None:
        """What watches the run: the non-finite check, the straggler timer and the metrics writer."""
        config, train = self.config, self.config.train
        # fp16 overflows are expected (the loss scaler handles them): check the loss only.
        self.nan_check = NonFiniteCheck(self.device, check_grads=not train.fp16) \
            if train.check_for_nan_in_loss_and_grad else None
        self.stragglers = StragglerTimer(self.device, train.straggler_minmax_count) if train.log_straggler else None
        self._document_squares: int | None = None   # sum of n^2 over this rank's documents since the last log
        self.metrics = MetricsWriter(
            flops_per_iteration=flops_per_iteration(config.model, train.global_batch_size,
                                                    vocab_size=self.model.vocab_size,
                                                    frozen_base=config.posttrain.lora),
            tokens_per_iteration=train.global_batch_size * config.model.seq_length,
            num_gpus=self.mesh.world_size, global_batch_size=train.global_batch_size,
            peak_tflops=resolve_peak_tflops(train.peak_tflops, self.device, train.dtype_name),
            log_json=train.log_json, tensorboard_dir=train.tensorboard_dir,
            enabled=self.mesh.rank == self.mesh.world_size - 1,  # Megatron logs from the last rank
        )

    def _objective(self):
        """The loss terms of a step: the LM's (LossTerms), with --dpo the preference loss
        (tessera.posttrain.dpo) against its reference, with --grpo the clipped policy gradient
        on the step's answers (tessera.posttrain.grpo)."""
        config = self.config
        if config.posttrain.grpo:
            from tessera.posttrain.grpo import GRPOObjective

            return GRPOObjective(config.posttrain, dp_group=self.mesh.group("dp"), pp_group=self.mesh.group("pp"),
                                 device=self.device, rollout_metrics=lambda: self.train_data.metrics())
        if not config.posttrain.dpo:
            return LossTerms(config.model, self.mesh, self.device)
        from tessera.posttrain.dpo import DPOObjective, PrecomputedReference, PreferenceTerms

        objective = DPOObjective(config.posttrain.dpo_beta, config.posttrain.dpo_sft_loss_weight,
                                 dp_group=self.mesh.group("dp"), pp_group=self.mesh.group("pp"),
                                 cp_group=self.mesh.group("cp"), device=self.device)
        # Without LoRA the initial model's log-probs are computed once (_reference_pass).
        return PreferenceTerms(objective, self._reference(adapters_off=True) if config.posttrain.lora
                               else PrecomputedReference())

    def _train_data(self):
        """This rank's training micro-batches: the datasets', or with --grpo the answers the inference
        engine samples from this model (tessera.posttrain.grpo_rollout)."""
        if not self.config.posttrain.grpo:
            return self.data.micro_batches("train", consumed_samples=self.consumed_samples)
        from tessera.posttrain.grpo_rollout import Rollouts, log_probs_by_micro_batch

        return Rollouts(self.model, self.data.datasets["train"], self.data.tokenizer, self.config, self.mesh,
                        device=self.device, reference=self.initial_model,
                        log_probs=log_probs_by_micro_batch(self._token_losses) if self.pipeline is None
                        else self._pipeline_token_log_probs,
                        before_rollout=self.optimizer.wait_for_parameters, start_iteration=self.iteration)

    def _keep_initial_model(self) -> None:
        """GRPO's reference without LoRA: a frozen copy of the start weights, before a resume replaces them."""
        from tessera.posttrain.dpo import frozen_reference

        self.optimizer.wait_for_parameters()
        self.initial_model = frozen_reference(self.model, self._token_losses).model

    def _reference(self, *, adapters_off: bool):
        """DPO's reference: this model run on each micro-batch (with LoRA, its adapters off), or
        under pipeline parallelism on a step's micro-batches through the forward-only schedule."""
        from tessera.posttrain.dpo import ModelReference, PipelinedReference
        from tessera.posttrain.lora import adapters_off as off

        context = off if adapters_off else contextlib.nullcontext
        if self.mesh.pp_size > 1:
            return PipelinedReference(lambda micro_batches: self._pipeline_reference(micro_batches, context))
        return ModelReference(self.model, self._token_losses, context, self.mesh.group("cp"))

    def _token_losses(self, model: GPTModel, batch: Batch) -> torch.Tensor:
        """The per-token losses [b, s] of `model` on a batch (a DPO reference's forward pass)."""
        with autocast(self.device.type, self.amp_dtype):
            return model(batch["tokens"], labels=batch["labels"], position_ids=batch.get("position_ids"))

    def _pipeline_reference(self, micro_batches: list[Batch], context) -> None:
        """DPO's reference log-probs of the micro-batches' rows [rows] through the forward-only schedule."""
        from tessera.posttrain.dpo import REFERENCE_KEY, answer_log_probs

        cp_group = self.mesh.group("cp")
        self._pipeline_values(micro_batches, REFERENCE_KEY, lambda batch: batch["tokens"].shape[:1],
                              lambda losses, batch: answer_log_probs(losses, batch["loss_mask"], cp_group),
                              self.model, context)

    def _pipeline_token_log_probs(self, model: GPTModel, context, micro_batches: list[Batch], key: str) -> None:
        """GRPO's per-token log-probs [rows, seq] of `model` (pi_old, the reference) through the
        forward-only schedule (tessera.posttrain.grpo_rollout.LogProbs)."""
        self._pipeline_values(micro_batches, key, lambda batch: batch["labels"].shape, lambda losses, batch: -losses,
                              model, context)

    @torch.no_grad()
    def _pipeline_values(self, micro_batches: list[Batch], key: str, shape, value, model: GPTModel, context) -> None:
        """`value(per-token losses, batch)` of each micro-batch (of `shape(batch)`) through the
        forward-only schedule of `model` (this stage, or a frozen copy of it), in evaluation mode
        inside `context(model)`, stored under `key` on every stage: the last stage computes them,
        the sum over the stages shares them."""
        from tessera.posttrain.dpo import eval_mode

        for batch in micro_batches:
            batch[key] = torch.zeros(shape(batch), device=self.device)

        def keep(losses: torch.Tensor, batch: Batch) -> None:
            batch[key] = value(losses, batch).float()

        with context(model), eval_mode(model):
            self._run_pipeline(self.pipeline.eval_runner, micro_batches, None, last_stage=keep, model=model)
        for batch in micro_batches:
            dist.all_reduce(batch[key], group=self.mesh.group("pp"))

    def _reference_pass(self) -> None:
        """DPO's precomputed reference: the model's log-probs of every row of the datasets, now."""
        from tessera.posttrain.dpo import precompute_reference_log_probs

        self.optimizer.wait_for_parameters()
        initial = self._reference(adapters_off=False)
        micro_batches = self.config.num_micro_batches if self.mesh.pp_size > 1 else 1
        for dataset in self.data.datasets.values():
            if dataset is not None:
                dataset.attach_reference_log_probs(precompute_reference_log_probs(
                    dataset, initial, micro_batch_size=self.config.train.micro_batch_size, device=self.device,
                    place=self._to_device, micro_batches=micro_batches, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                    dp_group=self.mesh.group("dp")))

    def _step_graph(self) -> StepGraph | None:
        """--cuda-graph-impl full_iteration: the forward and backward passes as one CUDA graph."""
        train = self.config.train
        if train.cuda_graph_impl == "none":
            return None
        if self.device.type != "cuda":
            raise ConfigError(f"--cuda-graph-impl {train.cuda_graph_impl} needs a CUDA device (training on "
                              f"{self.device.type})")
        return StepGraph(self._forward_backward, warmup_steps=train.cuda_graph_warmup_steps,
                         drop_statistics=self.moe.drop_statistics)

    # -- pipeline parallelism ------------------------------------------------------------

    def _stage_forward(self, chunk: int, batch: Batch, hidden: torch.Tensor | None, last_stage,
                       model: GPTModel) -> torch.Tensor:
        """One chunk of `model` (this stage's) on one micro-batch: its output activation, or on the last
        virtual stage `last_stage(per-token losses, batch)` (the objective's share: LossTerms.micro_batch)."""
        stage = self.pipeline.runner.stage(chunk)
        position_ids, documents = batch.get("position_ids"), batch.get("documents")
        layers = [model.layers[i] for i in self.pipeline.chunks[chunk]]
        with autocast(self.device.type, self.amp_dtype):
            if stage == 0:
                hidden = model.embed(batch["tokens"], position_ids)
            hidden = model.run_layers(hidden, position_ids, documents, layers=layers)
            if stage < self.pipeline.runner.last_stage:
                return hidden
            if self._with_mtp(model):
                losses = model.head_with_mtp(hidden, batch["tokens"], batch["labels"], position_ids, documents)
            else:
                losses = model.head(hidden, batch["labels"])
        return last_stage(losses, batch)

    def _run_pipeline(self, runner: PipelineRunner, micro_batches: list[Batch], loss_scale: torch.Tensor | None,
                      last_stage=None, model: GPTModel | None = None) -> None:
        """Run a schedule of `model` (by default this stage's) over the micro-batches: the last stage
        gives each one's per-token losses to `last_stage` (by default the objective, where they add
        up). `loss_scale` (loss scale / global tokens) is what the last stage backpropagates."""
        self.optimizer.wait_for_parameters()   # stages call embed/run_layers/head, not the gather hooks
        last_stage, model = last_stage or self.losses.micro_batch, model or self.model

        def forward_step(chunk: int, index: int, hidden: torch.Tensor | None) -> torch.Tensor:
            output = self._stage_forward(chunk, micro_batches[index], hidden, last_stage, model)
            if runner.stage(chunk) < runner.last_stage or loss_scale is None:
                return output
            return output * loss_scale

        last_backwards = runner.schedule.last_backwards(self.mesh.pp_rank)
        runner.run(forward_step, before_backward=lambda mb, chunk: self.optimizer.set_last_micro_batch(
            (mb, chunk) in last_backwards))   # each chunk's buckets may start in its own last backward

    # -- one iteration -----------------------------------------------------------------

    @staticmethod
    def _with_mtp(model: GPTModel) -> bool:
        """Whether the MTP depths run: in training (evaluation reports the LM loss only)."""
        return model.mtp is not None and model.training

    def _forward(self, batch: Batch) -> torch.Tensor:
        """One micro-batch's part of the objective: its masked loss sum (LossTerms.micro_batch)."""
        with autocast(self.device.type, self.amp_dtype):
            losses = self.model(batch["tokens"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                                documents=batch.get("documents"), mtp=self._with_mtp(self.model))
        return self.losses.micro_batch(losses, batch)

    def _forward_backward(self, micro_batches: list[Batch], loss_weight: torch.Tensor) -> None:
        """Every micro-batch's forward and backward pass into freshly zeroed gradients, each
        micro-batch's objective weighted by `loss_weight` (loss scale / the global batch's tokens)."""
        self.optimizer.zero_grad()
        self.losses.begin()
        for index, batch in enumerate(micro_batches):
            self.optimizer.set_last_micro_batch(index == len(micro_batches) - 1)
            (self._forward(batch) * loss_weight).backward()

    def train_step(self) -> StepResult:
        self.model.train()
        micro_batches = [self._to_device(next(self.train_data)) for _ in range(self.config.num_micro_batches)]
        if "documents" in micro_batches[0]:
            self._document_squares = (self._document_squares or 0) + sum(
                b["documents"].squared_lengths for b in micro_batches)
        tokens = self.losses.normaliser(micro_batches)   # the LM's global tokens (DPO: 1, its shares are normalised)
        scale = self.loss_scaler.scale
        self.moe.set_loss_scale(scale)
        if self.stragglers is not None:
            self.stragglers.start()
        if self.pipeline is not None:
            self.optimizer.zero_grad()
            self.losses.begin()
            self._run_pipeline(self.pipeline.runner, micro_batches, scale / tokens)
        elif self.step_graph is not None:
            self.step_graph.run(micro_batches, scale / tokens)
        else:
            self._forward_backward(micro_batches, scale / tokens)
        if self.stragglers is not None:
            self.stragglers.stop()   # before waiting for the other ranks' gradients
        self.optimizer.finish_grad_sync()
        moe_metrics = self.moe.finish_step(self.device) if self.moe.active else {}
        norm = self.optimizer.grad_norm()
        if self.loss_scaler.dynamic:  # the scale of the next iteration depends on this one
            self.loss_scaler.update(not torch.isfinite(norm).item())
        # Delayed scaling's next scales before the step: --fp8-param-gather casts the new weights with them.
        fp8.end_step(self.fp8_layers, self.mesh.group("tp_dp_cp"))
        norm = self.optimizer.step(norm, scale, self.lr_schedule(self.iteration),
                                   self.lr_schedule.decoupled(self.iteration))
        self.iteration += 1
        self.consumed_samples += self.config.train.global_batch_size
        loss, terms = self.losses.finish(tokens)
        return StepResult(loss, norm, self.optimizer.found_inf > 0, moe_metrics, terms)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        self.losses.begin()
        tokens = torch.zeros((), device=self.device)
        for _ in range(self.config.train.eval_iters):
            batches = [self._to_device(next(self.valid_data)) for _ in range(self.config.num_micro_batches)]
            tokens += self.losses.normaliser(batches)
            if self.pipeline is not None:
                self._run_pipeline(self.pipeline.eval_runner, batches, None)
            else:
                for batch in batches:
                    self._forward(batch)
        loss, _ = self.losses.finish(tokens)
        return loss.item()

    # -- the loop ----------------------------------------------------------------------

    def train(self) -> list[StepResult]:
        """Run to --train-iters (or --exit-interval); returns every iteration's resolved result."""
        train = self.config.train
        for line in run_summary(self.config, self.mesh, self.device, self.model.vocab_size, self.optimizer):
            self.metrics.info(line)
        history: list[StepResult] = []
        pending: list[StepResult] = []
        interval_start = time.perf_counter()
        with self._attention, self.checkpointer.exit_signal():
            while self.iteration < train.train_iters:
                pending.append(self.train_step())
                if self.startup is not None:   # said once, before the first iteration's line
                    self._synchronize()
                    self.startup.lap("first step (compiling)" if self.compiled else "first step")
                    self.metrics.info(self.startup.line())
                    self.startup = None
                if self.nan_check is not None:
                    self.nan_check.watch(self.iteration, pending[-1].loss, pending[-1].grad_norm)
                if self.iteration % train.log_interval == 0 or self.iteration == train.train_iters:
                    self._synchronize()
                    seconds = (time.perf_counter() - interval_start) / len(pending)
                    results = [r.resolve() for r in pending]
                    self._log(results, seconds)
                    if self.stragglers is not None:
                        self.metrics.info(self.stragglers.report())
                    history += results
                    pending, interval_start = [], time.perf_counter()
                if train.eval_interval and (self.iteration % train.eval_interval == 0
                                            or self.iteration == train.train_iters):
                    self.metrics.log_eval(self.iteration, self.evaluate())
                    interval_start = time.perf_counter()  # evaluation is not training time
                if self.checkpointer.after_iteration(self):  # saves when due; exit interval, SIGTERM, ...
                    break
        if self.nan_check is not None:
            self.nan_check.flush()
        history += [r.resolve() for r in pending]
        self.optimizer.gather_model_weights()   # the caller gets the whole model, not gathers in flight
        self.checkpointer.finish(self)
        self.metrics.close()
        return history

    def _log(self, results: list[StepResult], seconds_per_iteration: float) -> None:
        for result in results:
            if result.skipped:
                self.skipped_iterations += 1
                if not math.isfinite(result.grad_norm) and not self.config.train.fp16:
                    self.nan_iterations += 1
        losses = [r.loss for r in results if not r.skipped]
        moe = {name: sum(r.moe[name] for r in results) / len(results) for name in results[-1].moe}
        terms = {name: sum(r.terms[name] for r in results) / len(results) for name in results[-1].terms}
        self.metrics.log_iteration(IterationStats(
            iteration=self.iteration, train_iters=self.config.train.train_iters,
            consumed_samples=self.consumed_samples, seconds_per_iteration=seconds_per_iteration,
            loss=sum(losses) / len(losses) if losses else None,
            lr=self.optimizer.param_groups[0]["lr"], grad_norm=None if results[-1].skipped else results[-1].grad_norm,
            loss_scale=self.loss_scaler.scale, skipped_iterations=self.skipped_iterations,
            nan_iterations=self.nan_iterations, mem_gb=peak_memory_gb(self.device), moe=moe, terms=terms,
            flops_per_iteration=self._packed_flops_per_iteration(len(results)),
            decoupled_lr=self.lr_schedule.decoupled(self.iteration - 1),
        ))
        if self.pipeline is not None:
            self._log_bubble()

    def _log_bubble(self) -> None:
        """Measured idle fraction of each stage in the last step next to (p-1)/(v*m+p-1)."""
        measured = torch.tensor([self.pipeline.runner.measured_bubble()], device=self.device)
        stages = [torch.zeros_like(measured) for _ in range(self.mesh.pp_size)]
        dist.all_gather(stages, measured, group=self.mesh.group("pp"))
        self.metrics.info(f" pipeline bubble per stage: {' '.join(f'{s.item():.1%}' for s in stages)} "
                          f"(theory {self.pipeline.schedule.theoretical_bubble():.1%}, {self.pipeline.schedule.name})")

    def _packed_flops_per_iteration(self, iterations: int) -> float | None:
        """With packed documents, the model FLOPs of the logged iterations' mean, attention
        counted per document (sum of n^2 over all DP ranks' documents); else None (the fixed count).
        The TP, CP and PP ranks of one DP rank read the same documents: summed over DP only."""
        if self._document_squares is None:
            return None
        squares = torch.tensor(float(self._document_squares), dtype=torch.float64, device=self.device)
        if self.mesh.dp_group is not None:
            dist.all_reduce(squares, group=self.mesh.dp_group)
        self._document_squares = 0
        cfg = self.config
        return flops_per_iteration(cfg.model, cfg.train.global_batch_size, vocab_size=self.model.vocab_size,
                                   squared_document_lengths=squares.item() / iterations,
                                   frozen_base=cfg.posttrain.lora)

    def _to_device(self, batch: Batch) -> Batch:
        return place_batch(batch, self.device, self.document_backend, self.context_parallel)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _attention_backend(name: str, device: torch.device):
    """Context that orders SDPA kernels. On an H200, cuDNN attention is 1.8x as fast as
    FlashAttention-2 (bench/attention_backends.py, docs/performance.md), so 'auto' tries it first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return contextlib.nullcontext()
    order = {
        "auto": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH],
        "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH],
    }[name]
    return sdpa_kernel(order, set_priority=name == "auto")
