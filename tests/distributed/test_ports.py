"""The launcher's coordinator port: never the same for two launchers started at once."""

import os
import socket
import time
from pathlib import Path

from jaxstep._src.distributed import _ports
from jaxstep._src.distributed import launch


class _Draws:
    """A socket whose bind(0) gets the ports of ``draws`` in turn, as the OS might."""

    def __init__(self, draws):
        self.draws = iter(draws)

    def __call__(self):
        draws = self.draws

        class Sock:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, address):
                self.port = next(draws)

            def getsockname(self):
                return ("127.0.0.1", self.port)

        return Sock()


def test_a_port_handed_out_moments_ago_is_not_handed_out_again(tmp_path, monkeypatch):
    monkeypatch.setattr(_ports, "PORTS", tmp_path / "ports")
    # the OS gives both launchers 40001 (free until the first coordinator binds it)
    monkeypatch.setattr(socket, "socket", _Draws([40001, 40001, 40003]))
    assert launch.free_port() == 40001
    assert launch.free_port() == 40003


def test_a_stale_reservation_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(_ports, "PORTS", tmp_path / "ports")
    (tmp_path / "ports").mkdir()
    old = tmp_path / "ports" / "40005"
    old.touch()
    os.utime(old, (time.time() - 600, time.time() - 600))  # a run that ended long ago
    monkeypatch.setattr(socket, "socket", _Draws([40005]))
    assert launch.free_port() == 40005


def test_without_a_folder_to_reserve_in_the_os_port_stands(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.touch()
    monkeypatch.setattr(_ports, "PORTS", blocker / "ports")  # cannot be created
    monkeypatch.setattr(socket, "socket", _Draws([40007]))
    assert launch.free_port() == 40007


def test_real_ports_are_distinct_and_bindable(tmp_path, monkeypatch):
    monkeypatch.setattr(_ports, "PORTS", tmp_path / "ports")
    ports = [launch.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_real_ports_are_drawn_where_no_outgoing_connection_is_given_one(tmp_path, monkeypatch):
    # below the kernel's ephemeral range: the collectives' own sockets, or another run's,
    # cannot take the port between the draw and the coordinator's bind
    monkeypatch.setattr(_ports, "PORTS", tmp_path / "ports")
    low = 32768
    ephemeral = "/proc/sys/net/ipv4/ip_local_port_range"
    if os.path.exists(ephemeral):
        low = int(Path(ephemeral).read_text().split()[0])
    ports = [launch.free_port() for _ in range(5)]
    assert all(10000 <= p < low for p in ports), (ports, low)
