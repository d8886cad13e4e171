"""The run summary names a device that was never aggregated, with the reason it was last left out."""
from __future__ import annotations

from fed_server.records import RoundRecord, run_summary

WHY = "withdrew: ValueError: Expected more than 1 value per channel when training"


def _record(round_index: int, selected: list[str], aggregated: list[str], left: dict[str, str],
            status: str = "ok") -> RoundRecord:
    return RoundRecord.model_validate({
        "round": round_index, "round_id": round_index, "algorithm": "fedavg", "status": status, "test_accuracy": 0.5,
        "test_loss": 1.0, "train_loss": 1.0, "round_time_s": 1.0, "elapsed_s": float(round_index),
        "selected": selected, "aggregated": aggregated, "dropped": sorted(left), "split_points": {}, "device_times": {},
        "device_kinds": {}, "groups": [], "bytes_up": 0, "bytes_down": 0, "bytes_server": 0, "bytes_total": 0,
        "cumulative_bytes": 0, "plan_error": None, "left": left})


def _summary(history: list[RoundRecord]) -> dict:
    return run_summary(history, {}, {"test_accuracy": None}, len(history), 0, True, "completed")


def test_a_device_dropped_in_every_round_is_named_with_its_last_reason():
    history = [_record(1, ["a", "b", "c"], ["a"], {"b": "no upload by the round deadline", "c": WHY}),
               _record(2, ["a", "b", "c"], ["a", "b"], {"c": WHY}),
               _record(3, ["a", "c"], ["a"], {"c": "withdrew: the last one"})]
    assert _summary(history)["dropped_every_round"] == {"c": "withdrew: the last one"}


def test_no_device_is_named_when_each_was_aggregated_at_least_once():
    history = [_record(1, ["a", "b"], ["a"], {"b": WHY}), _record(2, ["a", "b"], ["b"], {"a": WHY})]
    assert _summary(history)["dropped_every_round"] == {}
