"""One agent of several taking its own slice of a shard list (``--slice INDEX/COUNT``).

The rule: the shard list, in the order given, is cut into COUNT contiguous blocks whose sizes
differ by at most one, the larger blocks first; agent INDEX (counted from 0) hosts block INDEX.
``--shards 0-9 --slice 1/3`` hosts 4-6 (blocks 0-3, 4-6, 7-9). Over the COUNT agents every shard
is hosted exactly once, and a device's id stays ``<prefix>-<shard>``: a run over several sliced
agents has the devices, ids and kinds (round-robin by shard) of the same run in one agent.
``INDEX`` may be ``auto``: the completion index a Kubernetes Indexed Job gives each of its pods
(the environment variable ``JOB_COMPLETION_INDEX``), or else the ordinal a StatefulSet gives its
pods, the host name's trailing ``-<ordinal>`` (pod ``agents-2`` is 2).
"""
from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence

AUTO = "auto"
#: Set by Kubernetes in every pod of an Indexed Job: the pod's index, 0 to ``completions - 1``.
JOB_INDEX_ENV = "JOB_COMPLETION_INDEX"


def shard_slice(shards: Sequence[int], index: int, count: int) -> list[int]:
    """Block ``index`` of ``shards`` cut into ``count`` contiguous blocks whose sizes differ by at
    most one, the larger first (empty when there are fewer shards than blocks)."""
    size, extra = divmod(len(shards), count)
    start = index * size + min(index, extra)
    return list(shards[start:start + size + (1 if index < extra else 0)])


def host_ordinal(hostname: str) -> int | None:
    """The trailing ``-<ordinal>`` of a host name's first label (``device-agents-2`` -> 2), None without one."""
    match = re.fullmatch(r".+-([0-9]+)", hostname.split(".", 1)[0])
    return int(match.group(1)) if match else None


def parse_slice(text: str, hostname: str | None = None, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``"1/3"`` -> ``(1, 3)``; ``"auto/3"`` takes INDEX from ``JOB_COMPLETION_INDEX`` in ``environ``
    (an Indexed Job's pod), else from ``hostname`` (default this host's name) with
    :func:`host_ordinal`. A one-line ValueError for anything else, INDEX >= COUNT included."""
    match = re.fullmatch(rf"({AUTO}|[0-9]+)/([0-9]+)", text.strip())
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"bad --slice {text!r}: use INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 0/3, or auto/COUNT "
                         f"(INDEX from the host name's trailing -<ordinal>)")
    index_text, count = match.group(1), int(match.group(2))
    job_index = environ.get(JOB_INDEX_ENV)
    if index_text == AUTO and job_index is not None:
        if not job_index.isdigit():
            raise ValueError(f"--slice {text}: {JOB_INDEX_ENV}={job_index!r} is not an index")
        index = int(job_index)
    elif index_text == AUTO:
        host = socket.gethostname() if hostname is None else hostname
        ordinal = host_ordinal(host)
        if ordinal is None:
            raise ValueError(f"--slice {text}: the host name {host!r} ends in no -<ordinal> (as a StatefulSet's pod "
                             f"device-agents-2 does); give INDEX")
        index = ordinal
    else:
        index = int(index_text)
    if index >= count:
        raise ValueError(f"--slice {text}: INDEX {index} is not below COUNT {count} (agents 0 to {count - 1})")
    return index, count


def agent_shards(shards: Sequence[int], text: str, hostname: str | None = None,
                 environ: Mapping[str, str] = os.environ) -> list[int]:
    """This agent's slice ``text`` (``--slice``, :func:`parse_slice`) of ``shards``; a one-line
    ValueError when it is empty (more agents than shards)."""
    index, count = parse_slice(text, hostname, environ)
    mine = shard_slice(shards, index, count)
    if not mine:
        raise ValueError(f"--slice {text}: agent {index} of {count} gets none of the {len(shards)} shards "
                         f"(more agents than shards)")
    return mine
