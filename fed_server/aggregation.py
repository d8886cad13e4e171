"""Aggregating an attempt: the contributions of its devices (their client portions with their
group's server portion), the algorithm's rule (Algorithm 1 or its own), and what the attempt
teaches the selection policy, the split planner and the client time table.

A private attempt (``privacy.clipping``; docs/privacy.md) never hands the algorithm a device's own
update: its devices' updates, each clipped to the round's bound, become one sum per state entry,
central noise is added to that sum, and the algorithm gets one contribution standing for every
device that supplied each entry (``Contribution.key_weights``) beside each device's group copy for
the blocks it does not hold. With the mean rule this is Algorithm 1 over the same devices, exactly
as from their clipped portions, plus the noise.

A securely aggregated attempt (``secure_aggregation.enabled``; docs/privacy.md) holds only masked
uploads: their sum is unmasked with the secrets the survivors' shares rebuild, decoded, and handed
to the algorithm as the same single contribution."""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fed_server.fed_round import FedRound
from fed_server.run_core import RunCore
from fed_server.split_planner import SplitPlanner
from fed_server.time_table import ClientTimeTable
from shared.algorithms.aggregation import Contribution
from shared.privacy.clipping import update_norm
from shared.privacy.noise import add_noise
from shared.secagg.encoding import decode_within, word_limit
from shared.secagg.masks import BlockLayout
from shared.secagg.protocol import DealingError, rebuild_secrets, state_to_words, unmasked_sum

log = logging.getLogger("fed_server")

#: The contribution that stands for a private or securely aggregated attempt's devices in the
#: sums of their updates.
PRIVATE_SUM = "#sum"


@dataclass
class Aggregation:
    """What aggregating a round attempt left for its record (:meth:`Aggregator.aggregate`)."""

    used: list[str]              # devices whose updates were aggregated
    dropped: set[str]
    ok: bool                     # the quorum was met and the global model changed
    extras: dict                 # the aggregated devices' validated upload extras
    aggregation_s: float
    #: The round record's privacy fields (``RunPrivacy.release``): the epsilon after the round...
    privacy: dict[str, Any] | None = None
    #: A securely aggregated attempt: the entries of the unmasked sum outside what the survivors'
    #: clipped updates can add up to, clamped to it (``RoundRecord.secure_clamped``).
    secure_clamped: int | None = None
    #: Why an attempt that met the quorum still failed (its masked sum could not be unmasked).
    failure: str | None = None


class Aggregator:
    """Aggregates closed attempts into the global model and updates the time table."""

    def __init__(self, core: RunCore, table: ClientTimeTable, planner: SplitPlanner) -> None:
        self.core = core
        self.table = table
        self.planner = planner

    def usable(self, fed_round: FedRound) -> list[str]:
        """The uploaders that can be aggregated: not dropped, and (split mode) with their group
        portion back; one whose group portion is missing is taken out with that reason."""
        dropped = fed_round.dropped()
        used = []
        for device in sorted(fed_round.updates):
            if device in dropped:
                continue
            if fed_round.uses_main_server and fed_round.portion_of(device) is None:
                # Its server-side layers never came back: its client layers alone would be averaged
                # against server layers trained without them. (No driver to wake: it is the caller.)
                fed_round.exclude([device], "its group portion never arrived")
                log.warning("round %d (attempt %d): %s not aggregated: its group portion never arrived",
                            fed_round.index, fed_round.round_id, device)
                continue
            used.append(device)
        return used

    def aggregate(self, fed_round: FedRound) -> Aggregation:
        """Aggregate (Algorithm 1 or the algorithm's rule) and update the time table. A round below
        the quorum changes nothing but the time table's entries of the devices it cut short (``ok``
        False): the same logical round is retried. A split device whose group portion is missing is not
        aggregated: it is taken out with that reason. Nothing is written to disk here. CPU work:
        run off the event loop."""
        used = self.usable(fed_round)
        secure = fed_round.secure
        if secure is not None:
            used = list(secure.plan.survivors) if secure.plan is not None else []
        dropped = fed_round.dropped()
        extras = {d: fed_round.updates[d].extras for d in used}
        ok = len(used) >= self.core.config.deadlines.min_participants
        aggregation = Aggregation(used, dropped, ok, extras, 0.0)
        if not aggregation.ok:
            self._observe_cuts(fed_round, used)
            return aggregation
        started = time.perf_counter()
        model, global_state = self.core.model, self.core.model.state_dict()
        if secure is not None:
            try:
                contributions = self._secure_contributions(fed_round, used, global_state, aggregation)
            except ValueError as exc:
                # Too few shares came back to remove the masks, or some owner's rebuild no secret
                # it committed to: the sum is unreadable, and the logical round is retried (without
                # such an owner: it sits out, as a device the attempt waited a deadline for).
                if isinstance(exc, DealingError):
                    secure.misdealt.update(exc.owners)
                aggregation.failure = f"the masked sum cannot be unmasked: {exc}"   # logged as it is counted
                aggregation.ok = False
                self._observe_cuts(fed_round, used)
                return aggregation
        elif self.core.privacy is not None:
            contributions = self._private_contributions(fed_round, used, global_state, aggregation)
        else:
            contributions = self._contributions(fed_round, used)
            for device, contribution in contributions.items():
                self.core.selector.observe(device, contribution, global_state)
        model.load_state_dict(self.core.algorithm.aggregate(fed_round.context, global_state, contributions, extras))
        aggregation.aggregation_s = time.perf_counter() - started
        self._observe_times(fed_round, used)
        self._observe_cuts(fed_round, used)
        return aggregation

    def _contributions(self, fed_round: FedRound, used: list[str]) -> dict[str, Contribution]:
        """Each aggregated device's contribution: its client portion, with its group's server portion."""
        contributions: dict[str, Contribution] = {}
        for device in used:
            update = fed_round.updates[device]
            portion = fed_round.portion_of(device) if fed_round.uses_main_server else None
            contributions[device] = Contribution(weight=update.request.num_samples, client_state=update.state,
                                                 server_state=portion.server_state(device) if portion else None)
        return contributions

    def _private_contributions(self, fed_round: FedRound, used: list[str], global_state: Mapping[str, torch.Tensor],
                               aggregation: Aggregation) -> dict[str, Contribution]:
        """The sums of the aggregated devices' clipped, weighted updates, noised (central noise), as
        one contribution beside each device's group copy for the blocks it does not hold; fills the
        record's privacy fields."""
        privacy = self.core.privacy
        assert privacy is not None
        sums, weights, inside = self._summed(fed_round, used, global_state, privacy.clip_norm)
        update_std, count_std = privacy.central_stds()
        # The step counters (integer entries) are outside the clip bound's norm, and get no noise.
        sums.update(add_noise({k: v for k, v in sums.items() if global_state[k].is_floating_point()}, update_std))
        unclipped = None   # adaptive clipping's noised count of updates inside the bound
        if privacy.adaptive is not None:
            unclipped = inside + float(add_noise({"n": torch.zeros(())}, count_std)["n"])
        aggregation.privacy = privacy.release(len(used), unclipped, fed_round.sample_rate)
        mean = {key: global_state[key].double() + total / weights[key] for key, total in sums.items()}
        return {PRIVATE_SUM: Contribution(weight=1.0, client_state=mean, key_weights=weights),
                **self._group_copies(fed_round, used, {d: set(fed_round.updates[d].state) for d in used})}

    def _group_copies(self, fed_round: FedRound, used: list[str], summed: Mapping[str, set[str]]
                      ) -> dict[str, Contribution]:
        """A split attempt whose devices' client portions are summed (private or secure): each
        device's group copy of the entries not in the sum (``summed``: each device's entries in
        it), weighed as the device (none at split depth zero)."""
        if not fed_round.uses_main_server:
            return {}
        copies = {}
        for device in used:
            portion = fed_round.portion_of(device)
            assert portion is not None   # usable() (or the unmasking plan) kept only devices with one
            held = summed[device]
            copies[device] = Contribution(
                weight=self.core.summed_weight(device), client_state={},
                server_state={k: v for k, v in portion.server_state(device).items() if k not in held})
        return copies

    def _secure_contributions(self, fed_round: FedRound, used: list[str], global_state: Mapping[str, torch.Tensor],
                              aggregation: Aggregation) -> dict[str, Contribution]:
        """A securely aggregated attempt: the survivors' masked words summed, the masks removed
        with the secrets rebuilt from the unmasking stage's shares, each entry's sum decoded and
        divided by the summed weights of the survivors that hold it (sample counts; 1 each with
        distributed noise, whose shares the sum carries), as one contribution beside each device's
        group copy for the blocks it does not hold (Algorithm 1, layer-wise). Each entry of the sum
        is first clamped to what the survivors' updates, each clipped to ``value_range`` and
        weighed, can add up to (plus their rounding): a survivor that uploaded beyond its range
        moves the mean by at most ``value_range``, not by the whole fixed-point range (two to four
        times that, more with dropouts); the entries clamped are counted and logged. A private attempt's
        round is counted in the ledger (fills the record's privacy fields). ValueError when fewer
        shares than the threshold came back."""
        secure = fed_round.secure
        assert secure is not None and secure.plan is not None and secure.roster is not None
        seeds, keys = rebuild_secrets(secure.answers, secure.neighbourhoods, used, secure.plan.dropped,
                                      secure.threshold, secure.committed(fed_round.round_id))
        layout = BlockLayout.of(self.core.model, self.core.head_start)
        total = unmasked_sum({d: state_to_words(fed_round.updates[d].state) for d in used}, layout, seeds, keys,
                             {d: k.mask_key for d, k in secure.roster.items()}, secure.neighbourhoods, secure.splits)
        held = {d: set(layout.held_keys(secure.splits[d])) for d in used}
        bits, value_range = secure.terms.fraction_bits, secure.terms.value_range
        weights: dict[str, float] = {}
        limits: dict[str, int] = {}   # in words: what the holders' encoded entries can add up to
        for device in used:
            weight = self.core.summed_weight(device)
            # As the device encodes its weighted entries: kept within weight * value_range.
            limit = word_limit(weight * value_range, bits)
            for key in held[device]:
                weights[key] = weights.get(key, 0.0) + weight
                limits[key] = limits.get(key, 0) + limit
        if self.core.privacy is not None:
            aggregation.privacy = self.core.privacy.release(len(used), None, fed_round.sample_rate)
        sums = {k: decode_within(v, bits, limits[k]) for k, v in total.items()}
        aggregation.secure_clamped = sum(outside for _, outside in sums.values())
        if aggregation.secure_clamped:
            log.warning("round %d (attempt %d): %d of %d entries of the unmasked sum were beyond what the survivors' "
                        "clipped updates can add up to, clamped: some survivor uploaded outside value_range (which "
                        "secure aggregation cannot tell)", fed_round.index, fed_round.round_id,
                        aggregation.secure_clamped, sum(v.size for v in total.values()))
        mean = {k: global_state[k].double() + torch.from_numpy(values) / weights[k] for k, (values, _) in sums.items()}
        return {PRIVATE_SUM: Contribution(weight=1.0, client_state=mean, key_weights=weights),
                **self._group_copies(fed_round, used, held)}

    def _summed(self, fed_round: FedRound, used: list[str], global_state: Mapping[str, torch.Tensor],
                clip_norm: float) -> tuple[dict[str, torch.Tensor], dict[str, float], float]:
        """Per entry, the weighted sum (float64) of the devices' updates, each clipped to ``clip_norm``
        here in float64 (the devices clipped theirs in their own precision; the Fed Server makes
        sure), and their summed weight; how many updates were inside the bound before their device
        clipped them (adaptive clipping's count: ``UpdateRequest.inside_clip``; the clipped upload's
        norm, at the bound give or take float32 rounding, cannot tell; a device that does not say is
        judged by that norm). Integer entries (a BatchNorm's step counter) are outside the norm and
        summed unclipped."""
        sums: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        inside = 0
        for device in used:
            received, w = fed_round.updates[device], self.core.summed_weight(device)
            state = received.state
            norm = update_norm(state, global_state)
            scale = w * min(1.0, clip_norm / norm) if norm > 0 else w
            said = received.request.inside_clip
            inside += said if said is not None else norm <= clip_norm
            for key, value in state.items():
                change = (value.double() - global_state[key].double()).mul_(scale if value.is_floating_point() else w)
                sums[key] = sums[key].add_(change) if key in sums else change
                weights[key] = weights.get(key, 0.0) + w
        return sums, weights, float(inside)

    def _observe_times(self, fed_round: FedRound, used: list[str]) -> None:
        """The aggregated devices' round times, into the split planner (the time table and the link
        rates) and the devices' usual times (:mod:`fed_server.device_pace`)."""
        self.core.pace.observe_attempt({d: (fed_round.assignments[d].split_point, fed_round.upload_seconds(d))
                                        for d in used})
        for device in used:
            assignment = fed_round.assignments[device]
            if assignment.candidate is not None:
                try:
                    self.planner.observe(device, assignment.candidate, fed_round.updates[device].round_time,
                                         *fed_round.table_parts(device))
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
