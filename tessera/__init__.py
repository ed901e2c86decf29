"""tessera: train transformer language models at any scale on PyTorch."""

__version__ = "0.1.0"
