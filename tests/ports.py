"""A TCP port for a test's server or rendezvous to bind later.

bind(("127.0.0.1", 0)) hands out a port from the kernel's ephemeral range, the range every
outgoing connection and every gloo socket also draws from: between the test choosing it and
its process binding it (seconds later, after importing torch) another job's sockets may take
it. A CI run hung so (tests/dist/test_launch.py's two concurrent jobs). The ports here lie
below that range, are free when chosen, and are not handed out twice in one process.
"""

from __future__ import annotations

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


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, outside the ephemeral range."""
    chooser = random.Random()   # not the global generator, which tests seed
    top = _ephemeral_start()
    for _ in range(1000):
        port = chooser.randrange(_LOWEST, top)
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
