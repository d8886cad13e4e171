"""Start the services by forking a warm process instead of a fresh interpreter.

A fresh ``python -m fed_server`` spends seconds of CPU importing torch, FastAPI and pydantic, and
more on ``torch._dynamo``, which torch imports at the first shape check on the meta device, before
it serves anything; a testbed starts three or four such processes, and the integration tests
start such testbeds dozens of times. A warm starter is one process (``python -m
testbed.warm_start``) that imports all that once and then forks a child per service: the child
sets up its session, log, working directory, environment and ``sys.argv`` and runs the module as
``python -m`` would (``runpy``). It is a separate process with its own sockets and state, the
service's code is the same, and it is stopped and killed the same way. A small testbed forked
so starts several times sooner (the times on the 2-core development machine: README.md, "Tests").

What a fork does not give, and why that is acceptable where it is used (the integration tests):

- Settings read once at interpreter start come from the warm process, not the child's
  environment: ``PYTHONUNBUFFERED``, ``OMP_NUM_THREADS`` (read when libgomp loads) and glibc's
  ``MALLOC_*`` variables. The warm process starts with :func:`testbed.processes.service_env`,
  the same values every service gets by default.
- ``/proc/<pid>/environ`` and ``/proc/<pid>/cmdline`` show the warm process's start, not the
  child's: a check of what a child holds there needs a real ``exec`` (``warm=None``, the
  default everywhere outside the tests).
- Memory is shared copy-on-write with the warm process, so the children's RSS and PSS are not
  those of separately started services; the benchmarks therefore start services with ``exec``.

The protocol between the launcher and the warm process is one JSON object per line each way:
a start request ``{"module", "args", "env", "cwd", "log"}`` is answered ``{"pid"}`` (or
``{"error"}``), and every child's end is reported ``{"exited": pid, "returncode": rc}``, with
``rc`` as :class:`subprocess.Popen` gives it (negative: killed by that signal).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

# What every service imports before it serves: the services' modules (which import torch, numpy,
# httpx and FastAPI), torch._dynamo (which torch imports at the first meta-device shape check and the
# first optimizer step), and the event loop and HTTP protocol uvicorn picks when it starts serving.
# A module that fails to import here is imported (and fails) in the child instead.
PRELOAD = ("fed_server.app", "main_server.app", "device_agent.agent", "torch._dynamo", "uvicorn.loops.auto",
           "uvicorn.protocols.http.auto")


class WarmStartError(RuntimeError):
    """The warm process could not start a child, or is gone."""


class WarmProcess:
    """A child of the warm process, with the part of :class:`subprocess.Popen` the testbed uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.args: list[str] = []   # the command line it stands for, as Popen.args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)   # only a wait with a timeout ends unset
        assert self.returncode is not None   # set before _exited is
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:   # as Popen: never signal a pid that may have been reused
            # The warm process may have reaped the child already and its end not yet be read here:
            # the child is gone, as Popen.send_signal also takes it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """The launcher's side: starts the warm process and asks it for children.

    ``preload``: the modules the warm process imports before it forks anything. One starter serves
    any number of testbeds, one request at a time; :meth:`close` (also run at interpreter exit)
    ends the warm process, not the children it started.
    """

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        from testbed.processes import service_env   # the one place that decides a child's defaults

        self._process = subprocess.Popen([sys.executable, "-m", "testbed.warm_start", *preload],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=service_env())
        assert self._process.stdin is not None and self._process.stdout is not None   # both piped above
        self._requests, self._messages = self._process.stdin, self._process.stdout
        self._lock = threading.Lock()           # one start request at a time
        self._replies: list[WarmProcess | str] = []   # a started child, or why none started
        self._replied = threading.Condition()
        self._children: dict[int, WarmProcess] = {}
        self._closed = False
        threading.Thread(target=self._read, name="warm-start-reader", daemon=True).start()
        atexit.register(self.close)

    def start(self, module: str, args: Sequence[str], env: Mapping[str, str], log_path: Path,
              cwd: str | None = None) -> WarmProcess:
        """Fork a child that runs ``python -m module args`` with ``env``, output appended to ``log_path``."""
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": cwd or os.getcwd(),
                   "log": str(log_path)}
        open(log_path, "ab").close()   # there once start returns, as when Popen is handed the file
        with self._lock:
            if not self.running():
                raise WarmStartError("the warm process is not running")
            self._requests.write(json.dumps(request).encode() + b"\n")
            self._requests.flush()
            with self._replied:
                if not self._replied.wait_for(lambda: self._replies or self._process.poll() is not None, timeout=60):
                    raise WarmStartError(f"the warm process did not answer a start of {module} within 60 s")
                if not self._replies:
                    raise WarmStartError(f"the warm process exited with code {self._process.returncode}")
                reply = self._replies.pop(0)
        if isinstance(reply, str):
            raise WarmStartError(f"could not start {module}: {reply}")
        reply.args = [sys.executable, "-m", module, *args]
        return reply

    def running(self) -> bool:
        """Whether the warm process is there to fork children (not closed, not exited)."""
        return not self._closed and self._process.poll() is None

    def _read(self) -> None:
        """Hand start replies to :meth:`start` and children's ends to their :class:`WarmProcess`."""
        for line in self._messages:
            message = json.loads(line)
            if "exited" in message:
                child = self._children.pop(message["exited"], None)
                if child is not None:
                    child._set_exited(message["returncode"])
                continue
            reply: WarmProcess | str = message.get("error", "")
            if "pid" in message:
                # Registered here, before the reply is handed on: the child's end, reported later on
                # the same stream, then always finds it, however soon the child ends.
                reply = self._children[message["pid"]] = WarmProcess(message["pid"])
            with self._replied:
                self._replies.append(reply)
                self._replied.notify_all()
        # The warm process is gone: no child's end can be reported any more, so none may outlive it
        # (a wait on it would never return).
        for child in list(self._children.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            child._set_exited(-signal.SIGKILL)
        self._children.clear()
        with self._replied:
            self._replied.notify_all()

    def close(self) -> None:
        """End the warm process. A testbed stops its children first; any still running are killed,
        since their end could no longer be reported."""
        if self._closed:
            return
        self._closed = True
        try:
            self._requests.close()
        except OSError:
            pass
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_shared: WarmStarter | None = None
_shared_lock = threading.Lock()


def shared_starter() -> WarmStarter:
    """One warm starter for this process, started on first use (the integration tests share it)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.running():
            _shared = WarmStarter()
        return _shared


# --- the warm process -------------------------------------------------------------------------

def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives a process, as the interpreter computes it."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_child(request: dict, base_path: list[str]) -> int:
    """In the forked child: become the service described by ``request`` and run it to its end."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # What `python -m` puts first on the path: the working directory, then PYTHONPATH.
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *(p for p in base_path if p not in extra)]
    importlib.invalidate_caches()
    try:
        import numpy
        numpy.random.seed()   # the legacy global generator would be the same in every child
    except ImportError:
        pass
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at its end: wait for non-daemon threads, then the atexit handlers.
    threading._shutdown()   # type: ignore[attr-defined]  # private: what the interpreter calls at its exit
    atexit._run_exitfuncs()
    return code


def _serve(preload: Sequence[str]) -> None:
    """Import ``preload``, then fork a child per request read from stdin until stdin closes."""
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    out = sys.stdout.buffer
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so that SIGCHLD writes to wake_w
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a Ctrl-C in the terminal is for the launcher

    def send(message: dict) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    pending = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:
                    send({"error": str(exc)})
                    continue
                if pid == 0:
                    code = 1
                    try:
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.default_int_handler)   # as a fresh interpreter
                        os.close(wake_r)
                        os.close(wake_w)
                        code = _run_child(request, base_path)
                    except BaseException:
                        traceback.print_exc()
                    finally:
                        try:
                            sys.stdout.flush()
                            sys.stderr.flush()
                        finally:
                            os._exit(code)
                send({"pid": pid})


if __name__ == "__main__":
    _serve(sys.argv[1:])
