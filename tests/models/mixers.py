"""What the Mamba-2 and Gated DeltaNet mixers' tests share: a mixer drawn away from its initial
values, and the check that packed documents give what each document gives alone."""

import torch
from torch import nn

from tessera.models.documents import Documents
from tessera.models.gpt import initialize_parameters


def perturbed(mixer: nn.Module, seed: int) -> nn.Module:
    """`mixer` initialised, then moved off its initial values, so that no part can be silently skipped."""
    initialize_parameters(mixer, seed)
    with torch.no_grad():
        for param in mixer.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return mixer


def assert_packed_documents_equal_separate_runs(mixer: nn.Module, hidden_size: int) -> None:
    """Two rows, the first packing documents of 7, 1 and 12 tokens: each equals its run alone."""
    lengths = [[7, 1, 12], [20]]
    x = torch.randn(2, 20, hidden_size)
    documents = Documents.from_cu_seqlens(torch.tensor([0, 7, 8, 20, 40]), 2, 20, backend="per_document",
                                          device=torch.device("cpu"))
    packed = mixer(x, documents)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            alone = mixer(x[row:row + 1, start:start + length])
            torch.testing.assert_close(packed[row:row + 1, start:start + length], alone, rtol=1e-5, atol=1e-6)
            start += length
