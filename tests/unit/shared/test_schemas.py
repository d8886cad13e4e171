"""Label counts at registration (several Main Server replicas) are checked like a join's."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.schemas import MAX_LABEL_COUNT, DeviceProfileMsg, JoinRequest, RegisterRequest


def _register(counts):
    return RegisterRequest(device_id="d0", shard=0, num_samples=5, profile=DeviceProfileMsg(flops=1e9, rate=1e6),
                           label_counts=counts)


def test_registration_label_counts_are_optional_and_bounded_like_a_joins():
    assert _register(None).label_counts is None
    assert _register([3, 0, 2]).label_counts == [3, 0, 2]
    for bad in ([], [0, 0], [-1, 4], [MAX_LABEL_COUNT + 1, 1]):
        with pytest.raises(ValidationError):
            _register(bad)
        if bad:   # a join with no counts is one whose device withheld them (split_privacy.label_counts)
            with pytest.raises(ValidationError):
                JoinRequest(device_id="d0", label_counts=bad, num_steps=1)
    assert JoinRequest(device_id="d0", label_counts=[], num_steps=1).label_counts == []
