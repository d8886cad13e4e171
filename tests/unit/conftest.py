"""Fixtures shared by the unit tests of several packages."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from fed_server.records import GroupRecord, RoundRecord

RecordFactory = Callable[..., RoundRecord]


@pytest.fixture
def round_record() -> RecordFactory:
    """Builds a round record as the Fed Server writes it: by default a clean round 1 (attempt 1)
    of ``dev-0`` and ``dev-1`` at split 1 in one group; keyword arguments replace fields."""
    def build(**fields: Any) -> RoundRecord:
        devices = fields.get("aggregated", ["dev-0", "dev-1"])
        split = fields.get("split_points", {d: 1 for d in devices})
        base: dict[str, Any] = dict(
            round=1, round_id=1, algorithm="s2fl", status="ok", test_accuracy=0.5, test_loss=1.25, train_loss=1.0,
            round_time_s=1.0, elapsed_s=2.0, selected=devices, aggregated=devices, dropped=[], split_points=split,
            device_times={}, device_kinds={},
            groups=[GroupRecord(group_id=0, members=devices, dropped=[], label_distance=None,
                                start_block=min(split.values(), default=0), train_time_s=1.0)],
            bytes_up=0, bytes_down=0, bytes_server=0, bytes_total=1_000_000, cumulative_bytes=2_000_000, plan_error=None)
        return RoundRecord(**{**base, **fields})
    return build
