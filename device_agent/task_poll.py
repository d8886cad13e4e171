"""A device's requests for its next instruction, and the pause between them."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from device_agent.api import FedApi
from shared.schemas import TaskResponse


@dataclass
class TaskPoller:
    """Asks the Fed Server what ``device_id`` is to do next (a long poll) and paces the asking:
    ``stop`` cuts a pause short; ``poll_interval_s`` is the shortest pause."""

    fed: FedApi
    device_id: str
    stop: threading.Event
    poll_interval_s: float

    def poll(self, wait_s: float) -> tuple[TaskResponse, int]:
        """The device's next instruction and the answer's size in bytes; the Fed Server may hold
        the request up to ``wait_s`` for work to arrive."""
        return self.fed.task(self.device_id, wait_s=wait_s)

    def pause_after(self, task: TaskResponse, asked_at: float, wait_s: float) -> None:
        """After an answer that is no task for now: ask again at once if the Fed Server held the
        request for the whole ``wait_s`` (it long-polls: work would have ended the wait), else
        (a server that answers at once) after its ``retry_after_s``."""
        if wait_s > 0 and time.monotonic() - asked_at >= wait_s:
            return
        self.stop.wait(self.retry_delay(task))

    def retry_delay(self, task: TaskResponse) -> float:
        """The server's ``retry_after_s``, bounded below by the poll interval and above by 5 s so
        a confused server cannot park a device."""
        return min(max(task.retry_after_s, self.poll_interval_s), 5.0)
