"""What a real one-layer tessera block saves for backward, the oracle of the planner's activation
memory: bytes of the tensors autograd keeps (bf16 autocast over fp32 weights, as tessera trains
without the distributed optimizer), counted with saved-tensor hooks. Weight casts are left out (the
model counts them with the weights), and so are per-token statistics and RoPE tables (norm and
log-sum-exp rows: under 1%)."""

import weakref

import torch

from tests.conftest import fused_as_on_gpus

B, S, H, HEADS = 2, 96, 320, 4      # b*s, h and ffn (4h) all differ, so shapes tell tensors apart


def saved_block_bytes(preset: str, *, compiled: bool, fp8_recipe: str | None = None, tp: int = 1,
                      sequence_parallel: bool = False):
    """(bytes saved for backward by one block of `preset` at B x S x H, its ModelConfig); with `tp` > 1
    this rank's share (its sequence shard under `sequence_parallel`), run under a process group of
    that many ranks (tests/dist/launcher.py)."""
    from tessera.cli.args import parse_run_config
    from tessera.config import ParallelConfig
    from tessera.kernels.fp8 import Fp8Recipe
    from tessera.models.gpt import GPTModel
    from tessera.parallel.mesh import Mesh
    from tessera.training.fp8 import apply_fp8

    config, _ = parse_run_config(["--model", preset, "--num-layers", "1", "--hidden-size", str(H),
                                  "--ffn-hidden-size", str(4 * H), "--num-attention-heads", str(HEADS),
                                  "--num-query-groups", str(HEADS), "--seq-length", str(S), "--hidden-dropout", "0",
                                  "--attention-dropout", "0", "--lr", "1e-3", "--train-iters", "1", "--mock-data"],
                                 "test")
    tp_group = Mesh.build(ParallelConfig(tensor_model_parallel_size=tp), "cpu").tp_group if tp > 1 else None
    model = GPTModel(config.model, tp_group=tp_group, sequence_parallel=sequence_parallel)
    block = model.layers[0]
    if fp8_recipe:
        apply_fp8([(0, block)], Fp8Recipe(format="hybrid", recipe=fp8_recipe), set(), B * S)
    if compiled:
        # Dynamo keeps a few compiled variants of a code object per process and runs later ones
        # eagerly: tests compiling other blocks before this one would otherwise measure eager mode.
        torch._dynamo.reset()
        block.compile()
    x = torch.randn(B, S // tp if sequence_parallel else S, H, requires_grad=True)
    rope = model.rotary(S, None) if model.rotary is not None else None
    # A TP shard of a [B, S, H] bf16 activation is twice the threshold.
    return bytes_saved_for_backward(block, x, rope, smaller_left_out=B * S * H // tp), config.model


def bytes_saved_for_backward(block, x: torch.Tensor, rope, *, smaller_left_out: int = 0) -> int:
    """Bytes of the storages autograd keeps when `block(x, rope)` runs under bf16 autocast on the
    CPU, the fused paths taken as on GPUs. Counted per storage: a saved view keeps all of it alive
    (V inside the fused QKV output). Left out: tensors shaped like a weight, its transpose or an
    expert's transpose (weight casts, counted with the weights), the RoPE tables (the model's, one
    copy for all layers), storages of fewer than `smaller_left_out` bytes (per-token statistics),
    and tensors freed before forward ends."""
    weight_shapes = {shape for p in block.parameters()
                     for shape in (tuple(p.shape), tuple(p.shape[::-1]), (*p.shape[:-2], *p.shape[-2:][::-1]))}
    tables = {t.untyped_storage().data_ptr() for t in rope or ()}
    saved = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if tuple(tensor.shape) not in weight_shapes and storage.data_ptr() not in tables \
                and storage.nbytes() >= smaller_left_out:
            saved.append(weakref.ref(tensor))
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            fused_as_on_gpus():
        output = block(x, rope)
    # What the output's graph still holds: a branch it does not need (a scan's unused final state)
    # has freed its saved tensors, and the allocator may have reused their addresses.
    alive = [tensor() for tensor in saved]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive if t is not None}
    del output   # the graph, kept until its tensors were counted
    return sum(storages.values())

