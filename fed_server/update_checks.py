"""Checks on what a device claims before the Fed Server believes it: the sample count it registers
with and its upload's claims (sample count, timings); the size of its update is measured and
clipped by ``shared/privacy/clipping.py``. What a device may
still do within these bounds: docs/security.md."""
from __future__ import annotations

import math

from shared.data.spec import DataSpec
from shared.errors import Invalid
from shared.schemas import DeviceTimings, RegisterRequest, UpdateRequest


def held_out_count(num_samples: int, fraction: float | None) -> int:
    """How many of a device's ``num_samples`` samples it holds out for federated evaluation: the
    size of :func:`shared.data.holdout.holdout_split`'s held-out part, ``floor(n * fraction)``
    (0 without a fraction). Its tests hold it to that function's split."""
    return math.floor(num_samples * fraction) if fraction else 0


def trained_samples(shard_size: int, holdout: float | None) -> int:
    """The count a device of a built-in data set registers with: its shard less the part it holds
    out for federated evaluation (``holdout``; None: the server evaluates)."""
    return shard_size - held_out_count(shard_size, holdout)


def max_held_out(train_samples: int, fraction: float) -> int:
    """The most samples a device that trains on ``train_samples`` can hold out with ``fraction``: the
    largest ``h`` for which ``n = train_samples + h`` samples split into exactly ``train_samples``
    training ones (:func:`held_out_count`), about ``train_samples * fraction / (1 - fraction)``,
    found in the device's own arithmetic."""
    held = math.floor(train_samples * fraction / (1 - fraction)) + 2   # above the answer, float error included
    while held > 0 and train_samples + held - held_out_count(train_samples + held, fraction) != train_samples:
        held -= 1
    return held


def shard_sizes(spec: DataSpec) -> list[int] | None:
    """The size of each shard of the run's built-in data set (``shared.data.partition``: the same
    pure function of the spec every device computes); None for ``dataset: local``, whose devices
    bring data the Fed Server does not know.

    Loads the training set once at start-up; the Fed Server loads it (with its test split) for
    server evaluation anyway, and a partition of it costs milliseconds."""
    if spec.dataset == "local":
        return None
    from shared.data import load_dataset   # torch-heavy: only where rounds run
    from shared.data.partition import partition_sizes

    return partition_sizes(spec, load_dataset(spec)[0])


def check_registered_samples(req: RegisterRequest, sizes: list[int] | None, holdout: float | None,
                             max_device_samples: int) -> None:
    """Refuse (:class:`Invalid`) a registration whose ``num_samples`` the run rules out.

    ``num_samples`` becomes the device's aggregation weight, and bounds what its uploads and
    evaluation reports may claim. A built-in data set's device holds exactly its shard (``sizes``,
    :func:`shard_sizes`) less the part it holds out for federated evaluation (``holdout``; None:
    the server evaluates), so any other count is refused; a device with its own data
    (``dataset: local``) may claim at most ``data.max_device_samples``. A shard the run does not
    have is left to the registry to refuse.
    """
    if sizes is not None and req.shard is not None and req.shard < len(sizes):
        expected = trained_samples(sizes[req.shard], holdout)
        if req.num_samples != expected:
            raise Invalid(f"num_samples={req.num_samples} of {req.device_id!r}: shard {req.shard} trains on "
                          f"{expected} samples")
    elif req.num_samples > max_device_samples:
        raise Invalid(f"num_samples={req.num_samples} of {req.device_id!r} exceeds data.max_device_samples="
                      f"{max_device_samples}")


def table_time(timings: DeviceTimings, upload_s: float = 0.0) -> float:
    """The time-table value of one device round: Eq. 1's terms, each measured.

    Client compute + transfer + the server-side training of the device's steps, + ``upload_s``:
    the seconds the device's upload took to reach the Fed Server, which the Fed Server times
    itself (the device's figures travel inside that upload, so they cannot include it). Not included:
    waiting at the group barrier for slower members (not the device's own cost) and the
    host-process overhead between those sections, which on a testbed with many virtual devices in
    one Python process is mostly interpreter contention, a cost no real device has.
    """
    return max(1e-6, timings.compute_s + timings.transfer_s + timings.server_s + upload_s)


#: Largest training loss an upload may report (either sign). Far above any loss of a training
#: that has not diverged; small enough that the round record's sample-weighted mean stays finite
#: (a reported 1e308 made it infinite, and ``/v1/status`` could no longer be encoded as JSON).
MAX_TRAIN_LOSS = 1e12


def check_claims(req: UpdateRequest, registered_samples: int, deadline_s: float) -> None:
    """Refuse (:class:`Invalid`) an upload whose claims the Fed Server knows to be impossible.

    * ``num_samples`` is the device's aggregation weight, so it must be the count the device
      registered with: a device cannot outweigh the others by claiming more data in one upload.
    * Every timing, and the time-table sum of :func:`table_time`, must fit in the round's
      deadline: an upload arrives before the attempt closes, so the device cannot have spent longer.
      Each figure alone may be finite and still overflow the sum (``1e308 + 1e308``).
    * ``train_loss`` lies within ``±MAX_TRAIN_LOSS``.
    """
    device_id, timings = req.device_id, req.timings
    if req.num_samples != registered_samples:
        raise Invalid(f"num_samples={req.num_samples} of {device_id!r} differs from the {registered_samples} "
                      f"samples it registered with")
    for name, value in timings.model_dump().items():
        if value > deadline_s:
            raise Invalid(f"timings.{name}={value:.4g}s of {device_id!r} exceeds the round deadline of {deadline_s:g}s")
    total = table_time(timings)
    if total > deadline_s:
        raise Invalid(f"timings compute_s + transfer_s + server_s = {total:.4g}s of {device_id!r} exceeds "
                      f"the round deadline of {deadline_s:g}s")
    if abs(req.train_loss) > MAX_TRAIN_LOSS:
        raise Invalid(f"train_loss={req.train_loss:.4g} of {device_id!r} is beyond ±{MAX_TRAIN_LOSS:g}")
