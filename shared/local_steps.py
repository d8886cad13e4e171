"""How many local steps a device's round takes: what the device trains (``device_agent/trainer.py``)
and what the Fed Server counts for it without asking (``fed_server/sample_privacy.py``) agree by
using this one rule."""
from __future__ import annotations

import math


def drops_last(num_samples: int, batch_size: int, no_single: bool) -> bool:
    """Whether an epoch's last batch (of one sample) is left out: ``no_single`` (a BatchNorm layer
    trains on the batch, which cannot be a single sample) and such a last batch, where the epoch
    has others (``device_agent.trainer.batches``)."""
    return no_single and num_samples > batch_size and num_samples % batch_size == 1


def steps_per_round(num_samples: int, batch_size: int, epochs: int, no_single: bool = False) -> int:
    """How many local steps a round of ``epochs`` passes over ``num_samples`` in batches takes
    (``no_single``: as in :func:`drops_last`)."""
    return epochs * (math.ceil(num_samples / batch_size) - drops_last(num_samples, batch_size, no_single))
