"""Which rank prints an error that several ranks of a job find.

A configuration error found after the ranks have started (a layer that cannot be split over the
tensor-parallel ranks, a tokenizer too large for the model) is found by every rank at once; a
missing file may be found by the ranks of one node only. The first rank to post a message on the
job's rendezvous store prints it, and the ranks that post the same message after it stay quiet:
each distinct error is printed once, whichever ranks find it.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch.distributed as dist

# How long the rank that serves the store stays up for the other ranks to post theirs: its exit
# takes the store down, and a rank that cannot reach the store prints its message itself.
_SERVER_GRACE_SECONDS = 5.0


def first_to_report(message: str) -> bool:
    """Whether this rank should print `message`: True for the first rank of the job to post it
    (and whenever there is no job, or its store cannot be reached)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    key = "tessera/errors/" + hashlib.sha256(message.encode()).hexdigest()[:16]
    try:
        store = dist.distributed_c10d._get_default_store()   # the rendezvous store of tessera.parallel.launch
        first = store.add(key, 1) == 1
        if dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            deadline = time.monotonic() + _SERVER_GRACE_SECONDS
            while store.add(key, 0) < dist.get_world_size() and time.monotonic() < deadline:
                time.sleep(0.05)
        return first
    except (RuntimeError, dist.DistError):
        return True
