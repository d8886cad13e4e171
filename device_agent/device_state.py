"""What an algorithm keeps on a device from one round to the next, held on disk between its rounds.

A device logic lives for one round (``shared/algorithms/base.py``); an algorithm whose logic
declares a ``State`` (SCAFFOLD's control variate c_i) has it restored before each round and keeps
a new one once its upload is built. In between, the state is a file, not memory: an idle device
of an agent hosting 10,000 holds nothing of it (the population benchmark's budget per idle
device, benchmarks/README.md, (h), holds whatever the state's size), and a state as large as the
model costs disk, not memory, per device. An algorithm without a ``State`` writes nothing.

One file per device and run: ``<directory>/run-<run id>/<device id>.msgpack``, the state's
payload map (:meth:`shared.algorithms.base.Payload.to_wire`) packed as msgpack and written
atomically (a temporary file, fsync, rename), so a state is read whole or not at all. It is read
back through the state's payload model, with every tensor checked against the model's trainable
parameters as a payload from the network is; nothing is ever unpickled.

The directory is the agent's ``--state-dir``: states then survive a restart of the agent (a
resumed run keeps its run id, so its devices find their states again). Without it, a temporary
directory made on first use and removed when the agent exits: a restarted agent's devices start
with no state, as devices that never trained.
"""
from __future__ import annotations

import hashlib
import logging
import re
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from shared.algorithms.base import P, parse_payload
from shared.errors import Invalid
from shared.files import atomic_write
from shared.wire import WireError, packb, unpackb

log = logging.getLogger("device_agent")

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class DeviceStates:
    """The kept states of an agent's devices, one file each (thread-safe: each device reads and
    writes only its own file)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        """``directory``: where the states live across agent restarts (``--state-dir``, made if
        missing); None: a temporary directory made when the first state is kept."""
        self._directory = Path(directory) if directory is not None else None
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        self._lock = threading.Lock()

    def _root(self) -> Path:
        with self._lock:
            if self._directory is None:
                self._temporary = tempfile.TemporaryDirectory(prefix="device-state-")
                self._directory = Path(self._temporary.name)
            return self._directory

    def path(self, run_id: str, device_id: str) -> Path:
        """The file of ``device_id``'s state in run ``run_id``. A run id that is not a plain name
        is hashed, so no id can name a path outside the directory."""
        run = run_id if _SAFE_NAME.fullmatch(run_id) else hashlib.sha256(run_id.encode()).hexdigest()[:32]
        return self._root() / f"run-{run}" / f"{device_id}.msgpack"

    def load(self, run_id: str, device_id: str, model: type[P], parameters: Mapping[str, torch.Tensor]) -> P | None:
        """The state ``device_id`` kept in run ``run_id``, validated as ``model`` against the
        model's trainable ``parameters``; None when it kept none. A file that does not parse (a
        disk fault, another version's state) is logged and counts as none."""
        path = self.path(run_id, device_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return parse_payload(model, unpackb(data), "device state", parameters)
        except (Invalid, WireError) as exc:
            log.warning("%s: kept state %s is unusable, starting without one: %s", device_id, path, exc)
            return None

    def keep(self, run_id: str, device_id: str, state: Mapping[str, object]) -> None:
        """Write ``state`` (a payload's wire map) as ``device_id``'s state in run ``run_id``."""
        path = self.path(run_id, device_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, packb(dict(state)))

    def discard(self, run_id: str, device_id: str) -> None:
        """Forget ``device_id``'s state in run ``run_id`` (the run is over for it), and the run's
        folder once it is empty."""
        if self._directory is None:
            return
        path = self.path(run_id, device_id)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:   # other devices' states are still there, or there is no folder
            pass

    def close(self) -> None:
        """Remove the temporary directory, if one was made (a ``--state-dir`` stays)."""
        with self._lock:
            if self._temporary is not None:
                self._temporary.cleanup()
                self._temporary = None
                self._directory = None
