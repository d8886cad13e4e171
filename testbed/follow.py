"""Following a run on a Fed Server: one line per round as it is recorded, then the run's summary
(``python -m testbed.follow`` also says how many devices have registered while the run waits).

``python -m testbed`` follows the run it started; ``python -m testbed.follow URL`` follows any Fed
Server's run, such as one whose devices are other machines (docs/deployment.md). Both wait on
the Fed Server's status long-poll (``GET /v1/status?seen=K&wait_s=W``, docs/api.md): a round is
printed as soon as its record is written, without polling.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable

import httpx

from fed_server.records import RoundRecord, parse_round_record
from shared.tls import tls_context

#: ``on_round(record, status)``: called once per round attempt, in order, with the attempt's
#: record and the status answer that brought it.
ProgressFn = Callable[[RoundRecord, dict], None]
#: ``status(since, seen, wait_s)``: the Fed Server's ``/v1/status`` answer as a dict.
StatusFn = Callable[[int, int, float], dict]
#: ``on_waiting(registered, expected)``: called while the run waits for its devices, each time
#: the number registered changes (and once at first).
WaitingFn = Callable[[int, int], None]
#: ``on_resumed(rounds)``: called once when the run followed resumed from its checkpoint after
#: ``rounds`` completed rounds, after the rounds it restored (when those are replayed).
ResumedFn = Callable[[int], None]


class FollowError(RuntimeError):
    """The run could not be followed to its end: the Fed Server stayed unreachable, its round
    driver failed, or the run did not finish in time."""


def fetch_status(fed_url: str, verify: bool | str = True) -> StatusFn:
    """A :data:`StatusFn` asking the Fed Server at ``fed_url`` (``verify``: as httpx's, or a CA file)."""
    def status(since: int = 0, seen: int = 0, wait_s: float = 0.0) -> dict:
        return httpx.get(f"{fed_url.rstrip('/')}/v1/status", params={"since": since, "seen": seen, "wait_s": wait_s},
                         timeout=10.0 + wait_s, verify=tls_context(verify)).json()
    return status


def follow_run(status: StatusFn, on_round: ProgressFn | None = None, timeout: float | None = None,
               wait_s: float = 1.0, retry_s: float = 0.5, patience_s: float = 120.0,
               check: Callable[[], None] | None = None, on_waiting: WaitingFn | None = None,
               on_resumed: ResumedFn | None = None, replay_restored: bool = True) -> dict:
    """Wait for the run to finish, calling ``on_round(record, status)`` for each new round attempt
    (and ``on_waiting`` while the run waits for its devices); return the final status, with every
    round's record.

    A run resumed from its checkpoint holds the records it restored: ``on_resumed(rounds)`` is told
    once, after them, and ``replay_restored`` False keeps them from ``on_round`` (``python -m
    testbed`` resuming its own run: its user saw them before the interruption).

    Each request is held by the Fed Server until a new record is written or the run finishes
    (long-poll); ``wait_s`` bounds the hold, and so how often ``check()`` runs between records
    (the testbed checks its processes there and raises if one died). A failed request is tried
    again after ``retry_s``; one that keeps failing for ``patience_s`` ends the follow.
    """
    deadline = time.monotonic() + timeout if timeout else None
    # ``since`` names a logical round: the last one whose successful record was printed. A
    # failed attempt of the next round is printed once (by attempt id) and asked for again until
    # that round succeeds, so neither the retry nor later rounds are missed. ``seen`` is the
    # server's count of records at its last answer: the next answer waits for more.
    done_round = 0
    seen = 0
    final = False   # the run finished; the last request asks for the whole history
    printed: set[int] = set()
    registered: int | None = None   # the count last passed to on_waiting
    announced = False                # the resume, to on_resumed
    failing_since: float | None = None
    while True:
        if check is not None:
            check()
        try:
            answer = status(0 if final else done_round, seen, 0.0 if final else wait_s)
            failing_since = None
        except httpx.HTTPError as exc:
            # A busy Fed Server (a VGG-16 evaluation on a loaded 2-core machine) can miss one
            # status request; only a server that stays unreachable ends the follow.
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > patience_s:
                raise FollowError(f"Fed Server status failed for {patience_s:.0f}s: {exc}") from exc
            time.sleep(retry_s)
            continue
        seen = answer["records"]
        if on_waiting and answer["state"] == "waiting_for_devices" and answer["registered"] != registered:
            registered = answer["registered"]
            on_waiting(registered, answer["expected_devices"])
        if answer.get("driver_error"):
            raise FollowError(f"Fed Server round driver failed: {answer['driver_error']}")
        restored_up_to = answer.get("resumed_after_attempt")
        for record in map(_round_record, answer["history"]):
            if record.round_id in printed:
                continue
            printed.add(record.round_id)
            if record.status == "ok":
                done_round = max(done_round, record.round)
            restored = restored_up_to is not None and record.round_id <= restored_up_to
            if not restored and restored_up_to is not None and not announced:
                announced = _announce_resume(answer, on_resumed)
            if on_round and (replay_restored or not restored):
                on_round(record, answer)
        if restored_up_to is not None and not announced:   # the history held the restored records alone
            announced = _announce_resume(answer, on_resumed)
        if answer["state"] == "finished":
            if final or done_round == 0:
                return answer
            # The requests asked only for records after the last printed round: ask once more
            # for the whole history, which the caller gets (it could be empty before).
            final = True
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise FollowError(f"run did not finish within {timeout:.0f}s (round {answer['rounds_done']} of {answer['rounds_total']})")


def _round_record(raw: dict) -> RoundRecord:
    """A record of a status answer, typed; FollowError for one this follower cannot read (a Fed
    Server of another version)."""
    try:
        return parse_round_record(raw)
    except ValueError as exc:
        raise FollowError(f"the Fed Server sent a record this follower cannot read: {exc}") from None


def _announce_resume(status: dict, on_resumed: ResumedFn | None) -> bool:
    """Tell ``on_resumed`` the rounds a resumed run had completed; True (it is told once)."""
    if on_resumed is not None:
        on_resumed(status["resumed_after_round"])
    return True


def format_resumed(rounds: int) -> str:
    """The line that says a run resumed from its checkpoint (its earlier rounds are not run again)."""
    return f"resumed after round {rounds}"


def _figure(value: float | None, form: str) -> str:
    """A figure of a round line, or n/a when the round has none."""
    return "n/a" if value is None else format(value, form)


def format_round(record: RoundRecord, status: dict) -> str:
    """One progress line per round: accuracy, or for a regression run (its initial figures hold a
    ``test_mse``) the MSE and MAE, then the loss."""
    splits = Counter(record.split_points.values())
    split_text = " ".join(f"{k}:{n}" for k, n in sorted(splits.items()))
    flag = "" if record.status == "ok" else f"  [{record.status}]"
    dropped = f"  dropped {len(record.dropped)}: {_names(record.dropped)}" if record.dropped else ""
    # Federated evaluation (the record counts evaluating devices) is marked "acc(fed)" ("mse(fed)");
    # a round without figures (no device reported) shows n/a.
    fed = "(fed)" if record.evaluated_devices is not None else ""
    if "test_mse" in (status.get("initial") or {}):
        figures = f"mse{fed} {_figure(record.test_mse, '.4f')}  mae {_figure(record.test_mae, '.4f')}"
    else:
        accuracy = record.test_accuracy
        figures = f"acc{fed} {'n/a' if accuracy is None else f'{100 * accuracy:6.2f}%'}"
    # A private run's epsilon so far at its delta (docs/privacy.md).
    privacy = record.privacy
    epsilon = (f"  eps {privacy.epsilon:.3f} (delta {privacy.delta:g})"
               if privacy is not None and privacy.epsilon is not None else "")
    return (f"round {record.round:>3}/{status['rounds_total']}  {figures}  "
            f"loss {_figure(record.test_loss, '.3f')}  round {record.round_time_s:5.1f}s  elapsed {record.elapsed_s:6.1f}s  "
            f"moved {record.bytes_total / 1e6:7.1f} MB (total {record.cumulative_bytes / 1e6:8.1f} MB)  "
            f"splits {split_text}{epsilon}{dropped}{flag}")


def _names(devices: list[str], shown: int = 3) -> str:
    """The first ``shown`` device ids, and how many more: a round line stays one line at any scale."""
    more = len(devices) - shown
    return ", ".join(devices[:shown]) + (f" +{more}" if more > 0 else "")


def format_waiting(registered: int, expected: int) -> str:
    """A line while the run waits for its devices (the rounds start when enough have registered)."""
    return f"waiting for devices: {registered} of {expected} registered"


def format_done(summary: dict) -> str:
    """The last line: the run's summary (``summary.json``): the final accuracy, or a regression
    run's final MSE and MAE; then a line for each device dropped in every round it was selected for."""
    if "final_mse" in summary:
        figures = (f"final mse {_figure(summary['final_mse'], '.4f')} (best {_figure(summary['best_mse'], '.4f')}, "
                   f"initial {_figure(summary['initial_mse'], '.4f')}), final mae {_figure(summary['final_mae'], '.4f')}")
    else:
        final = "n/a" if summary["final_accuracy"] is None else f"{100 * summary['final_accuracy']:.2f}%"
        best = "n/a" if summary["best_accuracy"] is None else f"{100 * summary['best_accuracy']:.2f}%"
        figures = f"final accuracy {final} (best {best})"
    # A summary written before it had dropped_every_round (a resumed older run) names none.
    never = summary.get("dropped_every_round") or {}
    lost = "".join(f"\n  dropped in every round it was selected for: {device} ({why})" for device, why in never.items())
    if summary.get("epsilon") is not None:
        figures += f", epsilon {summary['epsilon']:.3f} at delta {summary['delta']:g}"
    if summary.get("stop_reason") not in (None, "completed"):
        lost = f"\n  stopped: {summary['stop_reason']}" + lost
    return (f"done: {summary['rounds']} rounds, {figures}, "
            f"median round {summary['median_round_time_s']:.1f}s, total {summary['total_time_s']:.1f}s, "
            f"{summary['total_bytes'] / 1e6:.1f} MB moved{lost}")


def main(argv: list[str] | None = None) -> None:
    """``python -m testbed.follow URL``: print how many devices have registered while the run waits
    for them, a Fed Server's rounds as they are recorded (the ones recorded before too), then the
    summary line; exit 0 when the run finished, 1 if it could not be followed, 130 on Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m testbed.follow",
        description="Follow the run of a Fed Server: while it waits for its devices, how many have "
                    "registered (a line when the number changes); then one line per round as it is recorded "
                    "(the earlier rounds first), then the run's summary. Reads GET /v1/status, which needs no "
                    "credentials.")
    parser.add_argument("fed_server_url", help="the Fed Server, e.g. http://server:8080")
    parser.add_argument("--ca-file", default=None, help="CA bundle to verify an HTTPS Fed Server's certificate")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    args = parser.parse_args(argv)
    status = fetch_status(args.fed_server_url, args.ca_file or True)
    try:   # a wrong address fails at once, not after the patience for a busy server
        first = status(0, 0, 0.0)
    except (httpx.HTTPError, ValueError) as exc:
        parser.exit(1, f"follow failed: no Fed Server status at {args.fed_server_url}: {exc}\n")
    if not isinstance(first, dict) or not {"records", "history", "state"} <= first.keys():
        parser.exit(1, f"follow failed: {args.fed_server_url}/v1/status is not a Fed Server's status (a Main Server?)\n")
    try:
        final = follow_run(status, lambda record, answer: print(format_round(record, answer), flush=True),
                           timeout=args.timeout,
                           on_waiting=lambda count, expected: print(format_waiting(count, expected), flush=True),
                           on_resumed=lambda rounds: print(format_resumed(rounds), flush=True))
    except FollowError as exc:
        print(f"follow failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    print(format_done(final["summary"]), flush=True)


if __name__ == "__main__":
    main()
