"""Context parallelism against one process (gloo, 4 CPU processes, fp32).

Attention: every --cp-comm-type at CP=2 and CP=4 (a2a+p2p as 2 x 2) gives the outputs and
the q, k, v gradients of attention over the whole sequence (PyTorch's SDPA; the per-document
kernel for packed samples), and with packed documents nothing of document j reaches document
i, bitwise, though both are spread over every CP rank.

Training: the equivalence harness (tests/dist/equivalence.py: same losses and gradient norms
at every step, same parameters after the last, rtol 1e-5 -- it says why) for each comm type
at CP=2, CP=4, CP with TP + SP, DP with the distributed optimizer, FSDP2, PP, recompute,
MoE with experts folded over CP ranks and multi-latent attention, on mock data and on packed documents; and a
checkpoint saved at CP=2 resumed at CP=4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config import ParallelConfig
from tessera.models.attention import core_attention
from tessera.models.documents import Documents
from tessera.parallel.context import ContextParallel
from tessera.parallel.context_split import SplitDocuments, ZigzagSplit
from tessera.parallel.mesh import Mesh
from tests.dist.equivalence import BASE, assert_equivalent, result
from tests.dist.launcher import run_distributed
from tests.models.test_document_attention import packed_corpus

WORLD = 4

# -- attention ---------------------------------------------------------------------------------

SEQ, DIM = 32, 8
DOCUMENTS = [[5, 1, 14, 12], [SEQ], [3, 29]]
ATTENTION_LAYOUTS = {   # name: (CP size, comm type, hierarchical sizes)
    "CP=2 p2p": (2, "p2p", None), "CP=2 all_gather": (2, "all_gather", None), "CP=2 a2a": (2, "a2a", None),
    "CP=4 p2p": (4, "p2p", None), "CP=4 all_gather": (4, "all_gather", None), "CP=4 a2a": (4, "a2a", None),
    "CP=4 a2a+p2p (2 x 2)": (4, "a2a+p2p", [2, 2]),
}


def _inputs(packed: bool, seed: int = 0):
    """q [3, 8 heads, SEQ, DIM], k, v [3, 4 groups, ...], the output gradient, and the documents."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, weights = (torch.randn(3, heads, SEQ, DIM, generator=g) for heads in (8, 4, 4, 8))
    return q, k, v, weights, DOCUMENTS if packed else None


def _attention(context, q, k, v, weights, documents):
    """Output and q, k, v gradients of causal attention (within documents); context=None: one process."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = core_attention(q, k, v, documents, dropout_p=0.0, enable_gqa=True, context=context)
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _whole_documents(lengths):
    bounds = torch.tensor([0] + [row * SEQ + sum(doc[:i + 1]) for row, doc in enumerate(lengths)
                                 for i in range(len(doc))], dtype=torch.int32)
    return Documents.from_cu_seqlens(bounds, len(lengths), SEQ, backend="per_document", device=torch.device("cpu"))


def _context_attention(cp: ContextParallel, q, k, v, weights, lengths):
    """The same under context parallelism: this rank's pieces in, every rank's pieces gathered out."""
    split = ZigzagSplit.uniform(cp.size, SEQ) if lengths is None else ZigzagSplit.of_documents(lengths, cp.size)
    documents = None if lengths is None else SplitDocuments(split, _whole_documents(lengths))

    def local(t):
        return split.split(t.transpose(1, 2), cp.rank).transpose(1, 2).contiguous()

    results = _attention(cp.layer(0), *(local(t) for t in (q, k, v, weights)), documents)
    whole = []
    for t in results:
        parts = [torch.empty_like(t) for _ in range(cp.size)]
        dist.all_gather(parts, t.contiguous(), group=cp.group)
        whole.append(split.unsplit([p.transpose(1, 2) for p in parts]).transpose(1, 2))
    return whole, results, split


def _check_attention() -> list[str]:
    """On every rank: each layout against one process, and document isolation; the failures."""
    failures = []
    for name, (cp_size, comm_type, sizes) in ATTENTION_LAYOUTS.items():
        mesh = Mesh.build(ParallelConfig(context_parallel_size=cp_size, hierarchical_context_parallel_sizes=sizes),
                          "cpu")
        cp = ContextParallel((comm_type,), mesh.group("cp"), mesh.group("cp_inner"), mesh.group("cp_outer"))
        for packed in (False, True):
            q, k, v, weights, lengths = _inputs(packed)
            expected = _attention(None, q, k, v, weights, None if lengths is None else _whole_documents(lengths))
            actual, local, split = _context_attention(cp, q, k, v, weights, lengths)
            for what, a, e in zip(("output", "dq", "dk", "dv"), actual, expected):
                try:
                    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
                except AssertionError as error:
                    failures.append(f"{name}, packed={packed}: {what}\n{error}")
            if packed:
                failures += _isolation_failures(cp, (q, k, v, weights), local, split, name)
    return failures


def _isolation_failures(cp, inputs, local, split, name) -> list[str]:
    """New q, k, v for document 2 of sample 0 (spread over every rank) change its results and
    leave those of the other documents bitwise as they were, on every rank."""
    changed = [t.clone() for t in inputs]
    begin, end = sum(DOCUMENTS[0][:2]), sum(DOCUMENTS[0][:3])
    for t in changed[:3]:
        t[0, :, begin:end] = torch.randn(t[0, :, begin:end].shape, generator=torch.Generator().manual_seed(9))
    _, after, _ = _context_attention(cp, *changed, DOCUMENTS)
    inside = (split.positions(cp.rank)[0] >= begin) & (split.positions(cp.rank)[0] < end)
    failures = []
    for what, before_t, after_t in zip(("output", "dq", "dk", "dv"), local, after):
        if not (torch.equal(before_t[0][:, ~inside], after_t[0][:, ~inside]) and torch.equal(before_t[1:], after_t[1:])):
            failures.append(f"{name}: the {what} of other documents moved")
        if torch.equal(before_t[0][:, inside], after_t[0][:, inside]):
            failures.append(f"{name}: the {what} of the changed document did not change")
    return failures


# -- training --------------------------------------------------------------------------------

COMMON = ["--seq-length", "32", "--train-iters", "3", "--global-batch-size", "8"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
HIERARCHICAL = ["--hierarchical-context-parallel-sizes", "2", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MOCK = {
    "CP=2 p2p x DP=2, distributed optimizer": CP2 + ["--use-distributed-optimizer"],
    "CP=2 all_gather": CP2 + ["--cp-comm-type", "allgather"],
    "CP=2 a2a": CP2 + ["--cp-comm-type", "a2a"],
    "CP=4 p2p, FSDP2": CP4 + ["--use-torch-fsdp2"],
    "CP=4 a2a+p2p (2 x 2), full recompute": CP4 + ["--cp-comm-type", "a2a+p2p"] + HIERARCHICAL + [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "CP=2 x TP=2 + SP, selective recompute": CP2 + TP2_SP + ["--recompute-granularity", "selective"],
    "CP=2 x PP=2": CP2 + ["--pipeline-model-parallel-size", "2"],
}
PACKED = {
    "packed, CP=2 p2p": CP2,
    "packed, CP=2 all_gather": CP2 + ["--cp-comm-type", "all_gather"],
    "packed, CP=2 a2a": CP2 + ["--cp-comm-type", "a2a"],
    "packed, CP=4 a2a+p2p then p2p (per layer)": CP4 + ["--cp-comm-type", "a2a+p2p", "p2p"] + HIERARCHICAL,
    "packed, CP=2 x TP=2 + SP": CP2 + TP2_SP,
    "packed, CP=2 x PP=2": CP2 + ["--pipeline-model-parallel-size", "2"],
}
MOE = ["--model", "tiny-moe", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "1e-2"]
MOE_LAYOUT = {"MoE, CP=2 x EP=2 (experts folded over CP)": CP2 + ["--expert-model-parallel-size", "2"]}
# multi-latent attention (on tiny-gpt: no KV groups): queries and keys 16 + 8 wide, values 10 (the
# block kernels pad them)
MLA = ["--model", "tiny-gpt", "--position-embedding-type", "rope", "--multi-latent-attention", "--kv-lora-rank", "16", "--q-lora-rank", "24", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "10"]
MLA_LAYOUT = {"MLA, CP=2 p2p": CP2}
STOP = 2
RESHARD = (CP2 + ["--use-distributed-optimizer"], CP4)   # saved under, resumed under


def _train(flags: list[str]) -> dict:
    from tessera.cli.args import parse_run_config
    from tessera.training.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    config, _ = parse_run_config(flags, "test", world_size=world)
    trainer = Trainer(config)
    return result(trainer, trainer.train())


def _run_all(data: list[str], directory: str) -> dict:
    """On every rank: the attention checks, every training layout, and the checkpoint resharding."""
    runs = {"attention failures": _check_attention()}
    mock, packed = BASE + COMMON, [f for f in BASE if f != "--mock-data"] + COMMON + data
    runs.update({name: _train(mock + flags) for name, flags in MOCK.items()})
    runs.update({name: _train(packed + flags) for name, flags in PACKED.items()})
    runs.update({name: _train(mock + MOE + flags) for name, flags in MOE_LAYOUT.items()})
    runs.update({name: _train(mock + MLA + flags) for name, flags in MLA_LAYOUT.items()})
    saved, resumed = RESHARD
    before = _train(mock + saved + ["--save", directory, "--exit-interval", str(STOP)])["loss"]
    runs["resharded"] = before + _train(mock + resumed + ["--load", directory])["loss"]
    return runs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 272: the byte tokenizer's 257 ids rounded up to 8 x TP=2, the same padded vocabulary in every layout.
    return packed_corpus(tmp_path_factory.mktemp("packed")) + ["--vocab-size", "272"]


@pytest.fixture(scope="module")
def references(data):
    """Single-process runs (the packed one also builds the index cache the spawned ranks read)."""
    return {"mock": _train(BASE + COMMON), "moe": _train(BASE + COMMON + MOE), "mla": _train(BASE + COMMON + MLA),
            "packed": _train([f for f in BASE if f != "--mock-data"] + COMMON + data)}


@pytest.fixture(scope="module")
def runs(data, references, tmp_path_factory):
    return run_distributed(_run_all, WORLD, data, str(tmp_path_factory.mktemp("checkpoint")))[0]


def test_attention_of_every_comm_type_equals_one_process_and_isolates_documents(runs):
    assert not runs["attention failures"], "\n".join(runs["attention failures"])


@pytest.mark.parametrize("layout", list(MOCK) + list(PACKED) + list(MOE_LAYOUT) + list(MLA_LAYOUT))
def test_training_layout_matches_single_process(references, runs, layout):
    kind = {**dict.fromkeys(PACKED, "packed"), **dict.fromkeys(MOE_LAYOUT, "moe"), **dict.fromkeys(MLA_LAYOUT, "mla")}
    reference = references[kind.get(layout, "mock")]
    assert_equivalent(reference, runs[layout], layout)


def test_checkpoint_saved_at_cp2_resumes_at_cp4(references, runs):
    assert len(runs["resharded"]) == 3
    torch.testing.assert_close(runs["resharded"], references["mock"]["loss"], rtol=1e-5, atol=0)


def test_packed_runs_do_mask_documents(data, references):
    """Attending across documents gives other losses (by 4e-4 to 1e-3 here, 40x the equivalence
    tolerance): the packed layouts were compared with documents on."""
    across = _train([f for f in BASE if f != "--mock-data"] + COMMON + [f for f in data
                                                                         if f != "--reset-attention-mask"])
    assert across["loss"] != pytest.approx(references["packed"]["loss"], rel=2e-4)

