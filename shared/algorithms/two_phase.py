"""The two-phase protocol, a mixin pair for the algorithms that use it (FNR-FL).

In a two-phase round a device trains, then **reports** to the Fed Server (``POST .../reports``);
once reporting closes, the Fed Server answers every report with a **follow-up** (a ``follow_up``
task), the device acts on it and only then uploads. An algorithm takes part by mixing
:class:`TwoPhaseAlgorithm` into its :class:`~shared.algorithms.base.Algorithm` and
:class:`TwoPhaseLogic` into its :class:`~shared.algorithms.base.DeviceLogic`; the other algorithms
carry none of it. The services ask :func:`two_phase` which protocol an algorithm speaks, and
nothing else.

Both mixins are generic in their payloads (``TwoPhaseAlgorithm[Report, FollowUp]``,
``TwoPhaseLogic[FollowUp]``), validated where they arrive like every payload
(:func:`~shared.algorithms.base.parse_payload`): the report on the Fed Server, the follow-up on
the device.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar, overload

import torch

from shared.algorithms.base import Algorithm, DeviceLogic, Payload, RoundContext

if TYPE_CHECKING:
    from shared.data import ArrayDataset

ReportT = TypeVar("ReportT", bound=Payload)
FollowUpT = TypeVar("FollowUpT", bound=Payload)


class TwoPhaseLogic(ABC, Generic[FollowUpT]):
    """Device side of the protocol, mixed into the algorithm's ``DeviceLogic``: between training
    and the upload, what to report and what to do with the answer."""

    @abstractmethod
    def report(self, model: torch.nn.Module, data: "ArrayDataset") -> Payload:
        """What the device tells the Fed Server after training (the algorithm's ``Report``)."""

    @abstractmethod
    def follow_up(self, model: torch.nn.Module, data: "ArrayDataset", instruction: FollowUpT) -> None:
        """Act on the Fed Server's validated answer to the report (e.g. refine) before uploading."""


class TwoPhaseAlgorithm(ABC, Generic[ReportT, FollowUpT]):
    """Fed Server side of the protocol, mixed into the ``Algorithm``: its report and follow-up
    payload models and the plan that answers a round's reports."""

    #: A device's report (validated on the Fed Server) and the Fed Server's answer to it
    #: (validated on the device).
    Report: ClassVar[type[Payload]] = Payload
    FollowUp: ClassVar[type[Payload]] = Payload

    @abstractmethod
    def plan_follow_ups(self, ctx: RoundContext, reports: Mapping[str, ReportT]) -> dict[str, FollowUpT]:
        """Each reporting device's ``FollowUp`` to its validated ``Report`` (raise ValueError when
        no plan can be made: every reporter is then taken out of the attempt)."""


@overload
def two_phase(part: Algorithm) -> TwoPhaseAlgorithm | None: ...


@overload
def two_phase(part: type[Algorithm]) -> type[TwoPhaseAlgorithm] | None: ...


@overload
def two_phase(part: DeviceLogic) -> TwoPhaseLogic | None: ...


def two_phase(part: Algorithm | type[Algorithm] | DeviceLogic) -> TwoPhaseAlgorithm | type[TwoPhaseAlgorithm] | TwoPhaseLogic | None:
    """``part`` (an algorithm, its class, or its device logic) as its side of the two-phase
    protocol, or None when its devices upload right after training: the one place where the
    services tell the two protocols apart."""
    if isinstance(part, DeviceLogic):
        return part if isinstance(part, TwoPhaseLogic) else None
    if isinstance(part, type):
        return part if issubclass(part, TwoPhaseAlgorithm) else None
    return part if isinstance(part, TwoPhaseAlgorithm) else None
