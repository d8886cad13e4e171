"""``python -m benchmarks.profile_breakdown FILE...``: where a service's time goes, from py-spy samples.

Reads py-spy's raw (collapsed) output, one stack per line ending in its sample count, recorded
with ``py-spy record -f raw --idle --threads -n -r 50 -d 30 -p PID -o FILE``: every thread is
sampled, busy or not, so the shares are of thread time. A stack whose innermost Python frames
wait (a blocked socket read, an idle event loop, a sleep, a lock) counts as waiting (py-spy's own
idle detection counts a blocked read as active, so it is not used); every other stack is work
and goes to the first category whose marker it contains. The table gives each category's share
of all samples and, for work, of the work samples (benchmarks/README.md, "Profiles").
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

#: Waiting, by the innermost Python frame of the stack (a blocked read or an idle event loop is not work).
WAITING: list[tuple[str, tuple[str, ...]]] = [
    ("wait: reply from a peer (its work, the group barrier)", ("SyncStream.read",)),
    ("wait: idle event loop", ("Runner.run", "select (selectors.py", "BaseEventLoop._run_once")),
    ("wait: emulated device kinds (RoundClock sleeps)", ("RoundClock.",)),
    ("wait: sleeps and poll intervals (Event.wait)", ("sleep", "Event.wait")),
    ("wait: lock, queue or condition (idle workers)", ("Condition.wait", "SimpleQueue", "_worker (concurrent",
                                                       "Thread.join", "_wait_for_tstate_lock", "Lock", "Barrier", "queue.py")),
]
#: Work, by a marker anywhere in the stack: a stack belongs to the first category with one.
WORK: list[tuple[str, tuple[str, ...]]] = [
    ("work: GIL wait", ("take_gil",)),
    ("work: serialization (msgpack, shared/wire.py)", ("shared/wire.py", "msgpack", "portions.py")),
    ("work: schema validation (pydantic)", ("pydantic",)),
    ("work: compute, evaluation", ("evaluation.py",)),
    ("work: compute, training and aggregation (torch)", ("torch/", "libtorch", "aggregation.py",
                                                         "group_trainer.py")),
    ("work: HTTP (httpx, uvicorn, starlette, asyncio)", ("httpx", "httpcore", "h11", "uvicorn", "starlette",
                                                         "fastapi", "anyio", "asyncio", "socket", "ssl.py")),
    ("work: logging, metrics", ("logging/", "prometheus")),
]
OTHER = "work: other Python"


def classify(stack: str) -> str:
    """The category of one collapsed stack (``frame;frame;...``, outermost first)."""
    python_frames = [f for f in stack.split(";") if ".py:" in f]
    leaf = ";".join(python_frames[-2:])   # the innermost two: Event.wait sits on Condition.wait
    for name, markers in WAITING:
        if any(marker in leaf for marker in markers):
            return name
    for name, markers in WORK:
        if any(marker in stack for marker in markers):
            return name
    return OTHER


def breakdown(path: Path) -> tuple[Counter, int]:
    """Samples per category in one py-spy raw file, and the total."""
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[classify(stack)] += int(count)
    return counts, sum(counts.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_breakdown", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="py-spy raw output files")
    args = parser.parse_args(argv)
    for path in args.files:
        counts, total = breakdown(path)
        print(f"{path} ({total} samples)")
        work = sum(n for name, n in counts.items() if name.startswith("work"))
        for name, n in counts.most_common():
            of_work = f"  ({100 * n / work:5.1f} % of work)" if name.startswith("work") and work else ""
            print(f"  {100 * n / max(1, total):5.1f} %  {name}{of_work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
