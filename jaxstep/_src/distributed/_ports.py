"""The coordinator's port for a local job (``python -m jaxstep.launch``): one no other
launcher on this host hands out at the same time, reserved by a file in a shared folder
of the temporary directory."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
from pathlib import Path

#: Ports handed out by launchers on this host, a file each (``free_port``).
PORTS = Path(tempfile.gettempdir()) / "jaxstep-ports"
_HELD_S = 120.0  # a reservation outlives the seconds until the coordinator binds


def free_port() -> int:
    """A TCP port for the coordinator: free on 127.0.0.1 right now (the coordinator
    binds it moments later, once process 0 has imported JAX: seconds under load), and not
    handed out by another launcher on this host within ``_HELD_S``. In that gap the OS
    may give a launcher started at the same time the same port; its processes would then
    join this run's coordinator as its tasks ("a different incarnation"), and both runs
    die. Drawn below the kernel's ephemeral range first: there no outgoing connection
    (the collectives' own sockets, another run's) can be given the port in that gap
    either.

    Returns:
      The port number.

    Example:
      >>> import socket
      >>> from jaxstep.launch import free_port
      >>> port = free_port()
      >>> with socket.socket() as s:  # free: the coordinator can bind it
      ...     s.bind(("127.0.0.1", port))
    """
    port = 0
    for candidate in [*_below_ephemeral(16), *[0] * 64]:  # then the OS's own choice
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", candidate))
                port = int(s.getsockname()[1])
        except OSError:
            continue  # in use
        if _reserve(port):
            return port
    return port  # every draw reserved (or the folder unusable): the OS's word alone


def _below_ephemeral(count: int) -> list[int]:
    """``count`` random ports under the kernel's ephemeral range (Linux's
    ``ip_local_port_range``; 32768 where it cannot be read), above 10000."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low <= 10001 + count:
        return []
    return random.sample(range(10000, low), count)


def _reserve(port: int) -> bool:
    """Whether ``port`` is now this launcher's: its file created, or found stale."""
    mark = PORTS / str(port)
    try:
        PORTS.mkdir(mode=0o777, exist_ok=True)
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        return True
    except FileExistsError:
        try:
            if time.time() - mark.stat().st_mtime < _HELD_S:
                return False
            os.utime(mark)  # stale: the run that held it bound it long ago
            return True
        except OSError:
            return False
    except OSError:
        return True  # no folder to reserve in: as before, the OS's word alone


def unreserve(port: int) -> None:
    """The run that held ``port`` is over: another launcher may take it at once."""
    (PORTS / str(port)).unlink(missing_ok=True)
