"""The tensor-parallel layers at TP=1 are the plain torch layers and loss."""

import torch
import torch.nn.functional as F

from tessera.parallel.sharding import allreduce_sequence_parallel_grads, grad_norm_squared
from tessera.parallel.tensor import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy,
)


def test_cross_entropy_matches_torch_forward_and_gradient():
    logits = (20 * torch.randn(2, 5, 40)).requires_grad_()
    labels = torch.randint(0, 40, (2, 5))
    weights = torch.rand(2, 5)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), logits)
    loss = vocab_parallel_cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)


def test_cross_entropy_of_bf16_logits_is_fp32():
    logits = torch.randn(2, 5, 40).bfloat16().requires_grad_()
    labels = torch.randint(0, 40, (2, 5))
    loss = vocab_parallel_cross_entropy(logits, labels)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(loss.flatten(), expected, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_layers_without_a_group_are_plain_layers():
    column = ColumnParallelLinear(6, 4, bias=True, init_std=0.02, segments=(2, 2))
    row = RowParallelLinear(4, 6, bias=True, init_std=0.02)
    embedding = VocabParallelEmbedding(10, 6, init_std=0.02)
    for module in (column, row, embedding):
        for param in module.parameters():
            torch.nn.init.normal_(param)
    x, ids = torch.randn(2, 3, 6), torch.randint(0, 10, (2, 3))
    torch.testing.assert_close(column(x), F.linear(x, column.weight, column.bias), rtol=0, atol=0)
    torch.testing.assert_close(row(column(x)), F.linear(column(x), row.weight, row.bias), rtol=0, atol=0)
    torch.testing.assert_close(embedding(ids), F.embedding(ids, embedding.weight), rtol=0, atol=0)
    row(column(x)).sum().backward()
    grads = [p.grad.clone() for p in row.parameters()]
    allreduce_sequence_parallel_grads(row, None)  # nothing to do at TP=1
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, row.parameters()))
    params = list(column.parameters()) + list(row.parameters())
    torch.testing.assert_close(grad_norm_squared(params, [p.grad for p in params]),
                               sum(p.grad.square().sum() for p in params))
