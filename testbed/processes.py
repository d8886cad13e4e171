"""Start the services as separate processes on loopback, wait for them, stop them.

Used by the local testbed and by the integration tests, so the tests exercise exactly what users
run. The tests may start the same command lines by forking a warm process instead of a fresh
interpreter (``warm``: :mod:`testbed.warm_start` says what that changes).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from device_agent.slices import shard_slice
from shared.tls import tls_context
from testbed.warm_start import WarmProcess, WarmStarter

#: A line the services log at ERROR or CRITICAL (``shared.service``'s format: date, time, logger, level).
ERROR_LINE = re.compile(r"\S+ \S+ \S+ (ERROR|CRITICAL) ")


#: The ports this process has handed out: never handed out twice, and reserved for other processes
#: (:func:`free_port`) until this one exits.
_handed_out: set[int] = set()
_reservations: int | None = None
_handing_out = threading.Lock()   # one thread at a time checks and adds


def free_port(host: str = "127.0.0.1") -> int:
    """A free port (the OS picks it) that no other process using this function has been handed.

    Between the OS naming a free port and a service binding it (seconds: the service imports torch
    first), another process asking the OS the same way can be handed the same port: two test
    workers starting testbeds at once can be, and one testbed's agents then reach the other's Fed
    Server. So each port handed out is also reserved: a lock on its byte of a lock file that every
    process on this machine using this function shares, held until this process exits (the OS
    drops it then, even after SIGKILL). A reservation outlives the service (a service restarted
    on its port finds it still free) and is not given back: a process hands out a few ports per
    testbed, and the OS has tens of thousands."""
    with _handing_out:
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port: int = s.getsockname()[1]
            if port not in _handed_out and _reserve(port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port on {host}: 1,000 the OS offered were all reserved by testbeds")


def _reserve(port: int) -> bool:
    """Lock ``port``'s byte of the shared lock file for this process; False if another holds it.

    Where the lock file cannot be opened (another user's, say) the port is handed out unreserved,
    as the OS named it."""
    global _reservations
    if _reservations is None:
        path = Path(tempfile.gettempdir()) / f"sfl-ports-{os.getuid()}.lock"
        try:
            _reservations = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return True
    try:
        fcntl.lockf(_reservations, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
    except OSError:
        return False
    return True


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process: one torch thread, unbuffered output, the project importable.

    ``SFL_RUN__*`` variables are left out: the testbed has already resolved them into the config
    file it hands the Fed Server, and applying them twice would undo the testbed's own flags.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFL_RUN__")}
    env.setdefault("SFL_TORCH_THREADS", "1")
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


class SecretFiles:
    """Secrets written to owner-only files (mode 0600 in a 0700 folder) whose paths the children
    get through ``--*-secret-file`` flags.

    Neither a command line nor an environment is private: ``ps eww`` and ``/proc/<pid>/environ``
    show both to whoever can read the process table entry, while a 0600 file is readable by its
    owner alone. The folder is removed by :meth:`remove` when the testbed stops.
    """

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="sfl-secrets-"))  # mkdtemp creates it 0700
        self.paths: dict[str, str] = {}
        for name, value in secrets.items():
            path = self.folder / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(value)
            self.paths[name] = str(path)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class Service:
    """One child process and where its output goes."""

    name: str
    process: subprocess.Popen | WarmProcess
    log_path: Path
    module: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    # Started afresh under this command (``ip netns exec NS``; () for none) by ProcessGroup.start_under;
    # None: started as its group starts children (forked from the warm starter if there is one).
    prefix: tuple[str, ...] | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def why_it_stopped(self, lines: int = 30) -> str:
        """What to show of a process that exited with an error: its log from its first error line
        on (the reason, with the traceback that follows it), at most ``lines``; its last ``lines``
        when it logged no error. Not the whole tail: an agent started beside its servers logged
        that the Fed Server was not reachable yet, which says nothing about why it stopped later."""
        try:
            log = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [i for i, line in enumerate(log) if ERROR_LINE.match(line)]
        return "\n".join(log[errors[0]:][:lines] if errors else log[-lines:])


@dataclass
class ProcessGroup:
    """Every process a testbed started; stopping it stops them all.

    ``warm``: fork the processes from this warm starter instead of starting ``python -m`` afresh.
    """

    log_dir: Path
    warm: WarmStarter | None = None
    services: list[Service] = field(default_factory=list)

    def start(self, name: str, module: str, args: Sequence[str], env: dict[str, str] | None = None) -> Service:
        """Start ``python -m module`` as a member of this group (stopped with it)."""
        return self._add(Service(name, self._spawn(name, module, args, env), self.log_dir / f"{name}.log", module,
                                 tuple(args), env))

    def start_under(self, prefix: Sequence[str], name: str, module: str, args: Sequence[str],
                    env: dict[str, str] | None = None) -> Service:
        """:meth:`start` under the command ``prefix`` (``ip netns exec NS``, which then becomes the
        interpreter), always afresh: what the prefix does (enter a network namespace) a child forked
        from the warm starter could not do to itself on Python 3.11 (no ``os.setns``)."""
        return self._add(Service(name, self._exec(name, module, args, env, tuple(prefix)),
                                 self.log_dir / f"{name}.log", module, tuple(args), env, tuple(prefix)))

    def _add(self, service: Service) -> Service:
        self.services.append(service)
        return service

    def _spawn(self, name: str, module: str, args: Sequence[str],
               env: dict[str, str] | None) -> subprocess.Popen | WarmProcess:
        """``python -m module args``, forked from the warm starter if this group has one, else :meth:`_exec`."""
        if self.warm is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            return self.warm.start(module, args, service_env(env), self.log_dir / f"{name}.log")
        return self._exec(name, module, args, env, ())

    def _exec(self, name: str, module: str, args: Sequence[str], env: dict[str, str] | None,
              prefix: tuple[str, ...]) -> subprocess.Popen:
        """``prefix python -m module args`` in its own session, appending to ``log_dir/name.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log_file:
            return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], stdout=log_file,
                                    stderr=subprocess.STDOUT, env=service_env(env), start_new_session=True)

    def restart(self, service: Service, sig: int = signal.SIGKILL) -> Service:
        """Kill ``service`` with ``sig`` (default SIGKILL: no chance to clean up) and start it
        again with the same command line; the new process replaces it in place."""
        if service.alive():
            service.process.send_signal(sig)
        service.process.wait()
        service.process = (self._spawn(service.name, service.module, service.args, service.env) if service.prefix is None
                           else self._exec(service.name, service.module, service.args, service.env, service.prefix))
        return service

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM everyone, then SIGKILL whoever is still there after ``timeout``."""
        for s in self.services:
            if s.alive():
                s.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for s in self.services:
            try:
                s.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.process.kill()
                s.process.wait()


def wait_healthy(url: str, service: Service, timeout: float = 120.0, verify: bool | str = True) -> None:
    """Poll ``url/healthz`` until it answers 200; fail early if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            raise RuntimeError(f"{service.name} exited with code {service.process.returncode}:\n{service.why_it_stopped()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2.0, verify=tls_context(verify)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{service.name} did not become healthy at {url} within {timeout:.0f}s:\n{service.log_tail()}")


def split_evenly(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one (empty ones
    dropped): the blocks an agent's ``--slice i/parts`` takes (:mod:`device_agent.slices`)."""
    parts = max(1, min(parts, len(items)))
    return [c for c in (shard_slice(items, i, parts) for i in range(parts)) if c]
