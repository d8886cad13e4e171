"""Lists of names in one short line, for errors and log lines that may name many devices."""
from __future__ import annotations

from collections.abc import Sequence


def short_list(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, and how many more ("none" for none): one short line
    however many there are."""
    if not names:
        return "none"
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
