"""One batch memorised with AdamW under bf16 autocast: the training check of the GPU FP8 tests."""

import torch


def memorise(model: torch.nn.Module, tokens: torch.Tensor, steps: int = 20, lr: float = 1e-3
             ) -> tuple[list[float], torch.Tensor]:
    """Each step's loss, and the first step's gradients of model.layers flattened into one tensor."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for step in range(steps):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(tokens, labels=tokens).float().mean()
        loss.backward()
        if step == 0:
            first_grads = torch.cat([p.grad.flatten() for p in model.layers.parameters()])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first_grads
