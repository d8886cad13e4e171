"""Aggregating an attempt: the contributions of its devices (their client portions with their
group's server portion), the algorithm's rule (Algorithm 1 or its own), and what the attempt
teaches the selection policy, the split planner and the client time table."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fed_server.fed_round import FedRound
from fed_server.run_core import RunCore
from fed_server.split_planner import SplitPlanner
from fed_server.time_table import ClientTimeTable
from shared.algorithms.aggregation import Contribution

log = logging.getLogger("fed_server")


@dataclass
class Aggregation:
    """What aggregating a round attempt left for its record (:meth:`Aggregator.aggregate`)."""

    used: list[str]              # devices whose updates were aggregated
    dropped: set[str]
    ok: bool                     # the quorum was met and the global model changed
    extras: dict                 # the aggregated devices' validated upload extras
    aggregation_s: float


class Aggregator:
    """Aggregates closed attempts into the global model and updates the time table."""

    def __init__(self, core: RunCore, table: ClientTimeTable, planner: SplitPlanner) -> None:
        self.core = core
        self.table = table
        self.planner = planner

    def aggregate(self, fed_round: FedRound) -> Aggregation:
        """Aggregate (Algorithm 1 or the algorithm's rule) and update the time table. A round below
        the quorum changes nothing (``ok`` False): the same logical round is retried. A split device
        whose group portion is missing is not aggregated: it is taken out with that reason. Nothing
        is written to disk here. CPU work: run off the event loop."""
        contributions = self._contributions(fed_round)
        dropped = fed_round.dropped()
        used = list(contributions)
        extras = {d: fed_round.updates[d].extras for d in used}
        ok = len(used) >= self.core.config.deadlines.min_participants
        aggregation_s = 0.0
        if ok:
            started = time.perf_counter()
            model, global_state = self.core.model, self.core.model.state_dict()
            for device, contribution in contributions.items():
                self.core.selector.observe(device, contribution, global_state)
            model.load_state_dict(self.core.algorithm.aggregate(fed_round.context, global_state, contributions, extras))
            aggregation_s = time.perf_counter() - started
            self._observe_times(fed_round, used)
        self._observe_cuts(fed_round, used)
        return Aggregation(used, dropped, ok, extras, aggregation_s)

    def _contributions(self, fed_round: FedRound) -> dict[str, Contribution]:
        """Each uploader's contribution, less the dropped and those whose group portion is missing."""
        dropped = fed_round.dropped()
        contributions: dict[str, Contribution] = {}
        for device, update in sorted(fed_round.updates.items()):
            if device in dropped:
                continue
            portion = fed_round.portion_of(device) if fed_round.uses_main_server else None
            if fed_round.uses_main_server and portion is None:
                # Its server-side layers never came back: its client layers alone would be averaged
                # against server layers trained without them. (Off the event loop: no driver to wake.)
                fed_round.exclude([device], "its group portion never arrived")
                log.warning("round %d (attempt %d): %s not aggregated: its group portion never arrived",
                            fed_round.index, fed_round.round_id, device)
                continue
            contributions[device] = Contribution(weight=update.request.num_samples, client_state=update.state,
                                                 server_state=portion.server_state(device) if portion else None)
        return contributions

    def _observe_times(self, fed_round: FedRound, used: list[str]) -> None:
        """The aggregated devices' round times, into the split planner (the time table and the link
        rates) and the devices' usual times (:mod:`fed_server.device_pace`)."""
        self.core.pace.observe_attempt({d: (fed_round.assignments[d].split_point, fed_round.upload_seconds(d))
                                        for d in used})
        for device in used:
            assignment = fed_round.assignments[device]
            if assignment.candidate is not None:
                update = fed_round.updates[device]
                seconds = update.round_time
                # The device's own transfer figures count at most the round's time on this clock.
                transfer_s = min(update.request.timings.transfer_s + update.upload_s, fed_round.upload_seconds(device),
                                 seconds)
                compute_s = min(update.request.timings.compute_s, seconds - transfer_s)
                try:
                    self.planner.observe(device, assignment.candidate, seconds, transfer_s, compute_s)
                except ValueError as exc:
                    # accept_update bounds the timings; should one device's figures still be
                    # unusable, that device's cell is not updated, and the round goes on.
                    log.error("round %d (attempt %d): time of %s not recorded: %s", fed_round.index,
                              fed_round.round_id, device, exc)

    def _observe_cuts(self, fed_round: FedRound, used: list[str]) -> None:
        """The devices the attempt cut short (:meth:`FedRound.cut_short`), each a censored entry of
        the time table at its split: it took at least as long as it was waited for."""
        for device, waited_s in fed_round.cut_short(used).items():
            candidate = fed_round.assignments[device].candidate
            if candidate is not None:
                self.planner.censor(device, candidate, waited_s)
                log.info("round %d (attempt %d): %s cut short at split %d after %.1f s: the time table reads it "
                         "at least that", fed_round.index, fed_round.round_id, device,
                         fed_round.assignments[device].split_point, waited_s)
