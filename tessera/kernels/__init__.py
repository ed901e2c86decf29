"""Hand-written GPU kernels, for what neither PyTorch nor torch.compile does well enough."""
