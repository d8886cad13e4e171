"""How every service names a round in its logs: ``round N (attempt A)``.

``N`` is the logical round (1..rounds), ``A`` the attempt id the wire calls ``round_id``: a failed
attempt is retried as the same round under a new attempt id, so the two differ once any attempt
failed. A message from a peer that does not send the logical round (an older Fed Server) is named
by its attempt alone.
"""
from __future__ import annotations


def round_label(index: int | None, attempt: int | None) -> str:
    """``round N (attempt A)``; ``attempt A`` when the logical round is not known; ``round N``
    when there is no attempt (nothing was sent yet)."""
    if index is None:
        return f"attempt {attempt}"
    if attempt is None:
        return f"round {index}"
    return f"round {index} (attempt {attempt})"
