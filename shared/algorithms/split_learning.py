"""S2FL and SFL: split learning through the Main Server.

They differ only in their defaults; ``split.sliding`` and ``grouping.label_balance`` switch each
mechanism on or off, which gives the paper's ablations (S2FL+R = SFL, +B, +M, +MB), and
``grouping.method`` names any registered grouping plug-in instead (e.g. ``random``).
"""
from __future__ import annotations

from shared.algorithms.base import Algorithm, SplitMode


class S2FL(Algorithm):
    """Sliding split (client time table) + data-balance grouping (Eq. 2)."""

    default_sliding = True
    default_balance = True

    def split_mode(self) -> SplitMode:
        sliding = self.config.split.sliding
        return "sliding" if (self.default_sliding if sliding is None else sliding) else "fixed"

    def grouping(self) -> str:
        config = self.config.grouping
        if config.method is not None:
            return config.method
        balance = self.default_balance if config.label_balance is None else config.label_balance
        return "balanced" if balance else "singleton"


class SFL(S2FL):
    """Split federated learning: every device cut at the largest client portion, one server copy each."""

    default_sliding = False
    default_balance = False
