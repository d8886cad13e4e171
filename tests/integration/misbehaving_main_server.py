"""``python -m tests.integration.misbehaving_main_server [python -m main_server's arguments]``: a Main
Server replica whose group portions the Fed Server refuses.

It is the real Main Server (``main_server.__main__.main``, same arguments, same code); only the
group trainer it builds is :class:`CutShortPortionTrainer` for the duration of the call, whose
trained portion goes out with its first tensor (by name) one element short. The Fed Server refuses
such a portion (422: its shape is not the model's), so every group this replica trains ends
without its portion delivered: what the round's watch stream reports on ``done`` (``undelivered``).
"""
from __future__ import annotations

import logging
from unittest import mock

import main_server.__main__
from main_server.group_trainer import GroupTrainer
from shared.wire import decode_tensor, encode_tensor

log = logging.getLogger("misbehaving_main_server")


class CutShortPortionTrainer(GroupTrainer):
    """A group trainer whose portion, as encoded for the wire, has its first tensor one element short."""

    def wire_state(self) -> dict[str, dict]:
        state = super().wire_state()
        name = min(state)
        whole = decode_tensor(state[name], what=name)
        state[name] = encode_tensor(whole.flatten()[1:])
        log.warning("portion sent with %s cut short: %s elements, shape %s", name, whole.numel() - 1,
                    list(whole.shape))
        return state


def main(argv: list[str] | None = None) -> None:
    """Run ``python -m main_server`` with :class:`CutShortPortionTrainer` as its group trainer."""
    with mock.patch("main_server.group.GroupTrainer", CutShortPortionTrainer):
        main_server.__main__.main(argv)


if __name__ == "__main__":
    main()
