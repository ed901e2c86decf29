"""tessera as a library: a model, its layout and a training loop from Python, no command line.

The counterpart of Megatron-LM's `examples/run_simple_mcore_train_loop.py`. One process:

    python examples/simple_train_loop.py

or several, with the same code (tensor parallelism over 2 ranks, data parallelism over the rest):

    torchrun --nproc-per-node 4 examples/simple_train_loop.py

The configuration is plain dataclasses (`tessera.config`); each field is the `tessera train` flag
of the same name. Leave `RunConfig.world_size` out: it is the job's (torchrun's or SLURM's), and
the Trainer joins the job's process group itself.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig  # noqa: E402
from tessera.parallel.launch import job_world_size  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402


def build_config() -> RunConfig:
    tensor_parallel = 2 if job_world_size() % 2 == 0 else 1
    return RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=1024,
                          position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                          untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                          hidden_dropout=0.0, attention_dropout=0.0),   # so every layout prints the same losses
        parallel=ParallelConfig(tensor_model_parallel_size=tensor_parallel),
        data=DataConfig(mock_data=True, num_workers=0),
        optim=OptimConfig(lr=3e-3, lr_warmup_iters=2, lr_decay_style="cosine", weight_decay=0.1),
        train=TrainConfig(train_iters=20, micro_batch_size=2, global_batch_size=8, log_interval=5),
    )


def main() -> None:
    trainer = Trainer(build_config())
    # trainer.train() runs the whole loop (logging, evaluation, checkpoints); the loop below is the
    # same steps written out, for a custom loop of one's own.
    for _ in range(trainer.config.train.train_iters):
        result = trainer.train_step().resolve()   # one global batch: forward, backward, optimizer step
        if trainer.iteration % 5 == 0 and trainer.mesh.rank == 0:
            print(f"iteration {trainer.iteration:3d} | loss {result.loss:.4f} | grad norm {result.grad_norm:.3f}")
    trainer.optimizer.gather_model_weights()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
