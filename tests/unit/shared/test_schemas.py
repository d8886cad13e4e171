"""Label counts at registration (several Main Server replicas) are checked like a join's; what a
round plan says of a participant for the grouping (kind, time table row, measured link rate) is
bounded, and a registered kind always fits a plan."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.schemas import MAX_KIND_LENGTH, MAX_LABEL_COUNT, DeviceProfileMsg, JoinRequest, Participant, RegisterRequest
from shared.wire import packb, unpackb


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


def _participant(**fields) -> Participant:
    return Participant(device_id="d0", split_point=2, num_samples=5, **fields)


def test_a_participants_grouping_facts_cross_the_wire_and_are_checked():
    said = _participant(kind="low", round_times=[(1, 2.5), (3, 0.0)], link_rate=1e6)
    assert Participant.model_validate(unpackb(packb(said.model_dump()))) == said   # msgpack, as plans travel
    assert _participant().round_times == [] and _participant().kind is None and _participant().link_rate is None
    for bad in ({"round_times": [(0, 1.0)]}, {"round_times": [(1, -0.5)]}, {"round_times": [(1, float("inf"))]},
                {"round_times": [(2, 1.0), (2, 3.0)]}, {"link_rate": 0.0}, {"link_rate": float("nan")},
                {"kind": "k" * (MAX_KIND_LENGTH + 1)}):
        with pytest.raises(ValidationError):
            _participant(**bad)


def test_a_kind_too_long_for_a_round_plan_is_refused_at_registration():
    assert DeviceProfileMsg(kind="k" * MAX_KIND_LENGTH, flops=1.0).kind == "k" * MAX_KIND_LENGTH
    with pytest.raises(ValidationError):
        DeviceProfileMsg(kind="k" * (MAX_KIND_LENGTH + 1), flops=1.0)
