"""Local TCP ports for the tests' servers, chosen below the kernel's ephemeral range. A port from
that range (what binding port 0 gives) can become the source port of any outgoing connection
between its choice and the server's bind: two workers each starting a SeaweedFS (13 ports, the
S3 gRPC one bound seconds after the choice) failed one start in eight. Each pytest-xdist worker
draws from its own slice, and a process never hands out a port twice."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
"""Below it: ports that system services and the other tools a developer runs commonly listen on."""
_handed: set[int] = set()
_choice = random.SystemRandom().choice  # whatever seed a test gives the global generator


def _worker_ports() -> range:
    """This worker's slice of [``_LOWEST``, the ephemeral range's start); empty when the machine's
    ephemeral range leaves too little below it."""
    first_ephemeral = int(_EPHEMERAL.read_text().split()[0]) if _EPHEMERAL.exists() else 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0
    width = max(0, first_ephemeral - _LOWEST) // max(1, workers)
    start = _LOWEST + index * width
    return range(start, start + width)


def _unbound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing is bound to now, outside the ephemeral range where the machine
    allows it, and not handed out before by this process."""
    ports = _worker_ports()
    if len(ports) >= 1000:
        for _ in range(1000):
            port = _choice(ports)
            if port not in _handed and _unbound(port):
                _handed.add(port)
                return port
    with socket.socket() as s:  # a machine whose ephemeral range starts low: the kernel's choice
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed.add(port)
    return port
