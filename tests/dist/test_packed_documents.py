"""Packed-document training (--reset-attention-mask, --reset-position-ids, --eod-mask-loss on a
byte-level corpus of mixed-length documents) under TP=2 + SP and PP=2 against one process.

Same harness and tolerance as tests/dist/test_data_parallel.py (tests/dist/equivalence.py
says why). Under SP every rank's attention sees the whole sequence's documents; under PP
every stage reads the micro-batches, and so the documents, from its own loader.
"""

import pytest
import torch.distributed as dist

from tests.dist.equivalence import BASE, assert_equivalent, result
from tests.dist.launcher import run_distributed
from tests.models.test_document_attention import packed_corpus

LAYOUTS = {
    "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP=2": ["--pipeline-model-parallel-size", "2"],
}


def _train(flags: list[str]) -> dict:
    from tessera.cli.args import parse_run_config
    from tessera.training.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    config, _ = parse_run_config([f for f in BASE if f != "--mock-data"] + flags, "test", world_size=world)
    trainer = Trainer(config)
    return result(trainer, trainer.train())


def _train_layouts(data: list[str]) -> dict:
    return {name: _train(data + flags) for name, flags in LAYOUTS.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 272: the byte tokenizer's 257 ids rounded up to 8 x TP=2, the same padded vocabulary in every layout.
    return packed_corpus(tmp_path_factory.mktemp("packed")) + ["--vocab-size", "272"]


@pytest.fixture(scope="module")
def reference(data):
    return _train(data)   # also builds the index cache the spawned ranks read


@pytest.fixture(scope="module")
def results(data, reference):
    return run_distributed(_train_layouts, 2, data)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_documents_layout_matches_single_process(reference, results, layout):
    assert_equivalent(reference, results[layout], layout)


def test_the_runs_do_mask_documents(data, reference):
    """The same run attending across documents differs: the layouts above were compared with documents on."""
    across = _train([flag for flag in data if flag != "--reset-attention-mask"])
    assert across["loss"] != pytest.approx(reference["loss"], rel=1e-3)
