"""tessera: train transformer language models at any scale on PyTorch."""

import time

__version__ = "0.1.0"
IMPORTED_AT = time.perf_counter()   # the start of a run's start-up (tessera.training.startup)
