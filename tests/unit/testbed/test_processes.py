"""The testbed's process plumbing: secrets handed to the children as owner-only files, and free
ports that no two testbeds on one machine are handed at once."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from testbed import processes
from testbed.processes import SecretFiles, free_port


def test_secret_files_are_owner_only_and_removed():
    files = SecretFiles({"service": "s3cret", "enrolment": "3nrol"})
    try:
        assert stat.S_IMODE(os.stat(files.folder).st_mode) == 0o700
        for name, value in (("service", "s3cret"), ("enrolment", "3nrol")):
            path = files.paths[name]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert open(path).read() == value
    finally:
        files.remove()
    assert not files.folder.exists()


class _OfferedPorts:
    """Stands in for ``socket.socket``: each socket bound to port 0 gets the next port of ``offers``."""

    def __init__(self, offers: list[int]) -> None:
        self.offers = offers

    def __call__(self, *args: object) -> "_OfferedPorts":
        return self

    def __enter__(self) -> "_OfferedPorts":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = self.offers.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_os_offers_twice_is_handed_out_once(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        first = s.getsockname()[1]
    second = first + 1 if first < 65535 else first - 1
    monkeypatch.setattr(processes.socket, "socket", _OfferedPorts([first, first, second]))
    monkeypatch.setattr(processes, "_handed_out", set())
    assert free_port() == first
    assert free_port() == second


def test_a_port_another_process_was_handed_is_not_handed_out_until_that_process_exits(monkeypatch):
    monkeypatch.setattr(processes, "_handed_out", set())
    other = subprocess.Popen([sys.executable, "-c", "from testbed.processes import free_port; "
                              "print(free_port(), flush=True); input()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        taken = int(other.stdout.readline())
        monkeypatch.setattr(processes.socket, "socket", _OfferedPorts([taken, taken + 1]))
        assert free_port() == taken + 1
    finally:
        other.communicate("\n", timeout=30)
    monkeypatch.setattr(processes.socket, "socket", _OfferedPorts([taken]))
    assert free_port() == taken


def test_free_port_says_so_when_every_port_offered_is_taken(monkeypatch):
    monkeypatch.setattr(processes.socket, "socket", _OfferedPorts([40000] * 1001))
    monkeypatch.setattr(processes, "_handed_out", {40000})
    with pytest.raises(RuntimeError, match="no free port"):
        free_port()
