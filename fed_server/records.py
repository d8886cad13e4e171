"""What a round and a run leave behind: the metrics record of one round and the run summary."""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from fed_server.round_state import FedRound


def round_record(fed_round: FedRound, algorithm: str, used: Sequence[str], dropped: set[str], status: str,
                 accuracy: float, loss: float, duration: float, elapsed: float, cumulative_bytes: int,
                 device_kinds: Mapping[str, str]) -> dict:
    """The JSON line ``metrics.jsonl`` gets for one round attempt (docs/configuration.md lists the fields)."""
    updates = fed_round.updates
    up, down, server = round_bytes(fed_round)
    total_samples = sum(updates[d].request.num_samples for d in used) or 1
    train_loss = sum(updates[d].request.train_loss * updates[d].request.num_samples for d in used) / total_samples
    missing = sorted(set(fed_round.assignments) - set(updates) - dropped)
    return {
        "round": fed_round.index,
        "round_id": fed_round.round_id,
        "algorithm": algorithm,
        "status": status,
        "test_accuracy": accuracy,
        "test_loss": loss,
        "train_loss": train_loss if used else None,
        "round_time_s": duration,
        "elapsed_s": elapsed,
        "selected": sorted(fed_round.assignments),
        "aggregated": list(used),
        "dropped": sorted(dropped | set(missing)),
        "split_points": {d: a.split_point for d, a in sorted(fed_round.assignments.items())},
        "device_times": {d: u.request.timings.model_dump() for d, u in sorted(updates.items())},
        "device_kinds": {d: device_kinds.get(d, "unknown") for d in sorted(fed_round.assignments)},
        "groups": [{"group_id": p.upload.group_id, "members": p.upload.members, "dropped": p.upload.dropped,
                    "label_distance": p.upload.label_distance, "start_block": p.upload.start_block,
                    "train_time_s": p.upload.train_time_s} for _, p in sorted(fed_round.portions.items())],
        "bytes_up": up,
        "bytes_down": down,
        "bytes_server": server,
        "bytes_total": up + down + server,
        "cumulative_bytes": cumulative_bytes + up + down + server,
        "plan_error": fed_round.plan_failed,
    }


def round_bytes(fed_round: FedRound) -> tuple[int, int, int]:
    """(device uploads, device downloads, Fed <-> Main Server) body bytes of one round attempt."""
    updates = fed_round.updates.values()
    up = sum(u.request.bytes_up + u.body_bytes for u in updates)
    down = sum(u.request.bytes_down for u in updates) + fed_round.task_bytes
    server = fed_round.plan_bytes + sum(p.body_bytes for p in fed_round.portions.values())
    return up, down, server


def run_summary(history: Sequence[dict], base: Mapping, initial_accuracy: float, rounds_done: int,
                cumulative_bytes: int, finished: bool, stop_reason: str | None) -> dict:
    """``summary.json``: what the run achieved. Accuracy figures come from completed rounds only."""
    ok = [r for r in history if r["status"] == "ok"]
    accs = [r["test_accuracy"] for r in ok]
    times = [r["round_time_s"] for r in ok]
    return {
        **base,
        "rounds": rounds_done,
        "failed_attempts": len(history) - len(ok),
        "initial_accuracy": initial_accuracy,
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "final_loss": ok[-1]["test_loss"] if ok else None,
        "median_round_time_s": statistics.median(times) if times else None,
        "total_time_s": history[-1]["elapsed_s"] if history else 0.0,
        "total_bytes": cumulative_bytes,
        "finished": finished,
        "stop_reason": stop_reason,
        # A run that evaluated on data it also trained on (FNR-FL's paper-reproduction option)
        # says so in its summary, not only in its round records.
        "leaky": any(r.get("algorithm_metrics", {}).get("leaky") for r in history),
    }
