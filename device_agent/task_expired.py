"""The one way a device's task ends without failing: its attempt is over at the Fed Server."""
from __future__ import annotations


class TaskExpired(Exception):
    """The task's attempt is over at the Fed Server (its deadline passed, or the Fed Server closed
    it without this device's upload) before the device finished it: finishing it would only load
    the machine and the link and upload a stale model, and there is nothing left to withdraw from."""
