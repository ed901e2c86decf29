"""A TCP port for a test's server or rendezvous to bind later.

bind(("127.0.0.1", 0)) hands out a port from the kernel's ephemeral range, the range every
outgoing connection and every gloo socket also draws from: between the test choosing it and
its process binding it (seconds later, after importing torch) another job's sockets may take
it. A CI run hung so (tests/dist/test_launch.py's two concurrent jobs). The ports here lie
below that range, are free when chosen, and are not handed out twice in one process. Under
pytest-xdist (`make test` runs two workers) each worker draws from its own residue class, so two
workers never choose the same port either.
"""

from __future__ import annotations

import os
import random
import socket

_LOWEST = 10_000
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):   # not Linux: IANA's dynamic range
        return 49152


def _worker_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers); (0, 1) without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, outside the ephemeral range."""
    chooser = random.Random()   # not the global generator, which tests seed
    top = _ephemeral_start()
    index, workers = _worker_share()
    for _ in range(1000):
        port = _LOWEST + index + workers * chooser.randrange((top - _LOWEST) // workers)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port between {_LOWEST} and {top}")
