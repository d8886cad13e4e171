"""The Fed Server's side of secure aggregation (``secure_aggregation.enabled``; docs/privacy.md):
each attempt's stages, what devices send into them, and the masked sum they leave.

1. keys: each selected device sends two public keys; the stage closes once every device still in
   the attempt sent them, or ``stage_s`` after it opened; the devices that did not are taken out.
   The others (the roster) are laid out in neighbourhoods (``shared.secagg.graph``: SecAgg+'s
   sparse graph with ``neighbours``, else the complete graph), and each device is served its
   neighbourhood's keys and the threshold.
2. shares: each roster device sends its secret shares, sealed for each of its neighbours, with its
   commitments to them and to its seed; the stage closes the same way. A device fewer than ``threshold`` of whose neighbourhood shared could
   never be unmasked, so it is taken out too (and so on, until every remaining one has enough).
   Each device is then served the shares sealed for it by its neighbours that shared (those it
   masks with).
3. masked updates, through the usual upload (``/rounds/{id}/updates``); the attempt's upload
   deadlines apply.
4. unmasking: the devices that shared and uploaded (survivors) are asked for their shares of the
   survivors' seeds and of the dropped devices' mask keys, each checked against its owner's
   commitment as it comes (a false one is refused, naming the device); the stage closes once every
   survivor answered, or ``stage_s`` after it opened.

The Fed Server never holds a device's update: it sums the masked words, rebuilds the secrets from
the shares (``shared.secagg.protocol``) and removes the masks from the sum only."""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeVar

from fed_server.fed_round import FedRound, check_body_round
from fed_server.run_core import RunCore
from shared.errors import Conflict, Invalid, NotAllowed
from shared.schemas import (
    Ack, SecAggInbox, SecAggKeys, SecAggRoster, SecAggShares, SecAggUnmask, SecAggUnmaskPlan, SecureTerms,
)
from shared.secagg.crypto import DIGEST_BYTES, ShareError, check_public_key
from shared.secagg.encoding import fraction_bits
from shared.secagg.graph import Neighbourhoods, majority_threshold, neighbourhoods
from shared.secagg.masks import masked_splits, unprotected
from shared.secagg.protocol import COMMITMENTS_BYTES, DEALT_SHARE_BYTES, SECRETS, Committed, share_commitment
from shared.secagg.shamir import SHARE_BYTES, is_share
from shared.short_list import short_list

log = logging.getLogger("fed_server")

#: The most one share can take in a stage message on the wire: its recipient's or owner's id (64
#: bytes), a dealt share (``DEALT_SHARE_BYTES``; an unmasking share is smaller) and msgpack's headers.
SHARE_WIRE_BYTES = 288
#: The most a device's stage message takes besides its shares: its keys or commitments, its id and
#: (in a batch) its token, the field names.
DEVICE_WIRE_BYTES = 2048
#: The most map entries and array elements a device's stage message holds besides its shares: its
#: message's fields, its place in a batch's lists, its id and token there.
DEVICE_WIRE_ENTRIES = 16


class BodyLimit(NamedTuple):
    """What a body into the secure stages may hold (:meth:`SecureStages.message_limit`)."""

    bytes: int
    #: Map entries and array elements in all (``shared.wire.unpackb``'s ``max_entries``).
    entries: int

#: The longest a stage's long poll is held (``wait_s``).
MAX_STAGE_WAIT_S = 30.0
Answer = TypeVar("Answer", SecAggRoster, SecAggInbox, SecAggUnmaskPlan)
#: The stages a device asks about: stage 1's roster, stage 2's inbox, stage 4's question.
SecureStage = Literal["roster", "inbox", "unmask"]


@dataclass
class SecureRound:
    """One attempt's secure aggregation: the terms its tasks carry, and what each stage gathered.
    A stage's result is None while it is open; ``stage_closed`` is set each time one closes."""

    terms: SecureTerms
    keys: dict[str, SecAggKeys] = field(default_factory=dict)
    #: The device that sent each public key of ``keys``: no key may be two devices'.
    key_owners: dict[bytes, str] = field(default_factory=dict)
    roster: dict[str, SecAggKeys] | None = None
    #: Each roster device's neighbourhood (itself included, sorted), once the key stage closed.
    neighbourhoods: Neighbourhoods = field(default_factory=dict)
    #: The largest neighbourhood's size, once the key stage closed: what a stage message's body may
    #: carry is sized by it on every request (:meth:`SecureStages.message_limit`).
    largest_neighbourhood: int = 0
    #: The blocks ``[0, split)`` each roster device masks and uploads: those of its portion that at
    #: least ``threshold`` devices of its neighbourhood mask too (``shared.secagg.masks.masked_splits``).
    splits: dict[str, int] = field(default_factory=dict)
    threshold: int = 0
    #: Each sharer's dealt shares by recipient: sealed, then committed to (``DEALT_SHARE_BYTES``).
    shares: dict[str, dict[str, bytes]] = field(default_factory=dict)
    #: Each sharer's commitment to its seed, and to the shares it keeps itself.
    seed_commitments: dict[str, bytes] = field(default_factory=dict)
    own_commitments: dict[str, bytes] = field(default_factory=dict)
    sharers: list[str] | None = None
    plan: SecAggUnmaskPlan | None = None
    #: Each roster device's own question of stage 4: the plan's devices of its neighbourhood, the
    #: only ones it holds shares of (the whole plan for each of a thousand devices is a million ids).
    plans: dict[str, SecAggUnmaskPlan] = field(default_factory=dict)
    answers: dict[str, tuple[dict[str, bytes], dict[str, bytes]]] = field(default_factory=dict)
    #: The owners whose shares rebuilt no secret they committed to (``DealingError``), once summed.
    misdealt: set[str] = field(default_factory=set)
    stage_closed: asyncio.Event = field(default_factory=asyncio.Event)

    def held_up(self) -> set[str]:
        """The devices that held the attempt up in its unmasking: the survivors that sent no
        accepted answer (the stage waited ``stage_s`` for them; a false answer is refused) and the
        owners that dealt shares of no single secret (the attempt failed for them)."""
        silent = set(self.plan.survivors) - set(self.answers) if self.plan is not None else set()
        return silent | self.misdealt

    def committed(self, round_id: int) -> Committed:
        """What the roster committed to in attempt ``round_id``: each sharer's seed, each device's
        public mask key."""
        assert self.roster is not None
        return Committed(self.terms.run_id, round_id, self.seed_commitments,
                         {d: k.mask_key for d, k in self.roster.items()})

    def commitment(self, owner: str, holder: str, part: int) -> bytes:
        """``owner``'s commitment to the share of its seed (``part`` 0) or mask key (1) it dealt
        ``holder`` (itself included)."""
        both = self.own_commitments[owner] if owner == holder else self.shares[owner][holder][-COMMITMENTS_BYTES:]
        return both[part * DIGEST_BYTES:(part + 1) * DIGEST_BYTES]


def secure_round(core: RunCore, participants: list[str]) -> SecureRound:
    """A new attempt's secure aggregation, its fixed point sized for the summed weights of its
    ``participants`` (each device weighs its update by its sample count, or 1 with distributed
    noise: :meth:`RunCore.summed_weight`)."""
    secure = core.config.secure_aggregation
    total = sum(core.summed_weight(d) for d in participants)
    return SecureRound(SecureTerms(fraction_bits=fraction_bits(total, secure.value_range),
                                   value_range=secure.value_range, run_id=core.run_id))


class SecureStages:
    """What devices send into the open attempt's stages, and the stages' long polls."""

    def __init__(self, core: RunCore) -> None:
        self.core = core

    def _secure(self, round_id: int, device_id: str) -> tuple[FedRound, SecureRound]:
        """The open attempt ``round_id`` and its secure stages, which selected ``device_id`` and
        have not taken it out."""
        self.core.devices.get(device_id)
        fed_round = self.core.open_round(round_id)
        if fed_round.secure is None:
            raise Conflict(f"round {round_id} does not aggregate securely (secure_aggregation.enabled)")
        if device_id not in fed_round.assignments:
            raise NotAllowed(f"device {device_id!r} was not selected for round {round_id}")
        if device_id in fed_round.excluded:
            raise Conflict(f"device {device_id!r} was taken out of round {round_id}: {fed_round.excluded[device_id]}")
        return fed_round, fed_round.secure

    def message_limit(self, round_id: int, devices: int, limit: int) -> BodyLimit:
        """What the stage messages of ``devices`` devices of attempt ``round_id`` (one each, as
        many as the attempt has) can take at most: every device's largest message, its shares to
        its whole neighbourhood once the roster is out (an unmasking answer carries at most one
        share of each; before the roster a device can send only its keys), in bytes (at most
        ``limit``) and in map entries and array elements. A body past either is refused, in bytes
        before it is read, so a client cannot make the Fed Server parse far more than the attempt's
        own messages (millions of tiny entries take seconds of its event loop, a
        hundred times what their bytes in full shares would). An attempt that is not open or not
        secure takes a device's overhead each: every message in it is refused."""
        fed_round = self.core.round
        secure = fed_round.secure if fed_round is not None and fed_round.round_id == round_id else None
        if fed_round is None or secure is None:
            return BodyLimit(min(limit, devices * DEVICE_WIRE_BYTES), devices * DEVICE_WIRE_ENTRIES)
        shares = secure.largest_neighbourhood   # 0 before the roster
        senders = min(devices, len(fed_round.assignments))
        return BodyLimit(min(limit, senders * (shares * SHARE_WIRE_BYTES + DEVICE_WIRE_BYTES)),
                         senders * (shares + DEVICE_WIRE_ENTRIES))

    def accept_keys(self, round_id: int, req: SecAggKeys) -> Ack:
        """Stage 1: a device's public keys; Invalid for a key that agrees on nothing, or one sent
        already by another device of the attempt or as the device's other key (two devices with
        one key could cancel the pairwise masks of a neighbour: ``DeviceSecrets.check_roster``)."""
        check_body_round(req.round_id, round_id)
        _, secure = self._secure(round_id, req.device_id)
        if secure.roster is not None:
            raise Conflict(f"the key stage of round {round_id} is closed")
        try:
            check_public_key(req.mask_key)
            check_public_key(req.share_key)
        except ShareError as exc:
            raise Invalid(f"keys of {req.device_id!r}: {exc}") from None
        taken = {secure.key_owners.get(k, req.device_id) for k in (req.mask_key, req.share_key)} - {req.device_id}
        if taken or req.mask_key == req.share_key:
            raise Invalid(f"keys of {req.device_id!r}: a public key sent already by "
                          f"{sorted(taken)[0] if taken else 'itself as its other key'}; each must be fresh")
        if (earlier := secure.keys.get(req.device_id)) is not None:
            for key in (earlier.mask_key, earlier.share_key):
                del secure.key_owners[key]
        secure.keys[req.device_id] = req
        secure.key_owners.update({req.mask_key: req.device_id, req.share_key: req.device_id})
        self.core.changed.set()
        return Ack(detail=f"keys of {req.device_id} for round {round_id} stored")

    def accept_shares(self, round_id: int, req: SecAggShares) -> Ack:
        """Stage 2: a roster device's dealt shares, one for each other device of its neighbourhood,
        each of :data:`DEALT_SHARE_BYTES` (a share of another size could not open, and would only
        reach its recipient to make it withdraw), and its commitments."""
        check_body_round(req.round_id, round_id)
        _, secure = self._secure(round_id, req.device_id)
        if secure.roster is None or secure.sharers is not None:
            raise Conflict(f"the share stage of round {round_id} is not open")
        others = set(secure.neighbourhoods.get(req.device_id, [])) - {req.device_id}
        if req.device_id not in secure.roster or set(req.shares) != others:
            raise Invalid(f"shares of {req.device_id!r} must go to exactly its {len(others)} neighbours "
                          f"({short_list(sorted(others))})")
        wrong = sorted(d for d, dealt in req.shares.items() if len(dealt) != DEALT_SHARE_BYTES)
        if wrong:
            raise Invalid(f"shares of {req.device_id!r} for {short_list(wrong)}: not {DEALT_SHARE_BYTES} bytes")
        secure.shares[req.device_id] = dict(req.shares)
        secure.seed_commitments[req.device_id] = req.seed_commitment
        secure.own_commitments[req.device_id] = req.own_commitments
        self.core.changed.set()
        return Ack(detail=f"shares of {req.device_id} for round {round_id} stored")

    def accept_unmask(self, round_id: int, req: SecAggUnmask) -> Ack:
        """Stage 4: a survivor's shares of the survivors' seeds and the dropped devices' keys:
        exactly those it was asked for (its neighbourhood's), each a field element and the share its
        owner dealt it, as the owner committed to it (a false one would rebuild a wrong secret, or
        none, and fail the attempt for every device; the device checked the commitments when it
        opened its shares, so a false share is its own doing, and is logged)."""
        check_body_round(req.round_id, round_id)
        fed_round, secure = self._secure(round_id, req.device_id)
        plan = secure.plans.get(req.device_id)
        if plan is None or req.device_id not in plan.survivors:
            raise Conflict(f"round {round_id} asks {req.device_id!r} for no unmasking shares")
        for owners, asked, what in ((req.seed_shares, plan.survivors, "seeds"), (req.key_shares, plan.dropped, "keys")):
            if set(owners) != set(asked):
                raise Invalid(f"unmasking shares of {req.device_id!r}: the {what} of exactly "
                              f"{short_list(sorted(asked))} were asked for, not of {short_list(sorted(owners))}")
            wrong = sorted(o for o, share in owners.items() if not is_share(share))
            if wrong:
                raise Invalid(f"unmasking shares of {req.device_id!r} for {short_list(wrong)}: not a field element of "
                              f"{SHARE_BYTES} bytes")
        for part, owners in enumerate((req.seed_shares, req.key_shares)):
            false = sorted(o for o, share in owners.items()
                           if share_commitment(secure.terms.run_id, round_id, o, req.device_id, part, share)
                           != secure.commitment(o, req.device_id, part))
            if false:
                log.warning("round %d (attempt %d): %s answered the unmasking with shares of the %ss of %s that their "
                            "owners did not deal it: refused", fed_round.index, round_id, req.device_id,
                            SECRETS[part], short_list(false))
                raise Invalid(f"unmasking shares of {req.device_id!r}: the shares of the {SECRETS[part]}s of "
                              f"{short_list(false)} are not the ones their owners dealt it")
        secure.answers[req.device_id] = (dict(req.seed_shares), dict(req.key_shares))
        self.core.changed.set()
        return Ack(detail=f"unmasking shares of {req.device_id} for round {round_id} stored")

    async def ask(self, round_id: int, stage: SecureStage, device_id: str, wait_s: float
                  ) -> SecAggRoster | SecAggInbox | SecAggUnmaskPlan:
        """``stage``'s answer for ``device_id``, held up to ``wait_s`` until the stage closes."""
        if stage == "roster":
            return await self.roster(round_id, device_id, wait_s)
        if stage == "inbox":
            return await self.inbox(round_id, device_id, wait_s)
        return await self.unmask_plan(round_id, device_id, wait_s)

    async def roster(self, round_id: int, device_id: str, wait_s: float) -> SecAggRoster:
        """Stage 1's result for ``device_id``, once it closed (held up to ``wait_s`` till then):
        the keys of its neighbourhood and the threshold."""
        def answer(secure: SecureRound) -> SecAggRoster | None:
            if secure.roster is None:
                return None
            hood = secure.neighbourhoods[device_id]
            return SecAggRoster(ready=True, threshold=secure.threshold, keys={d: secure.roster[d] for d in hood},
                                splits={d: secure.splits[d] for d in hood})
        return await self._held(round_id, device_id, wait_s, answer, SecAggRoster(ready=False))

    async def inbox(self, round_id: int, device_id: str, wait_s: float) -> SecAggInbox:
        """Stage 2's result for ``device_id``: the shares sealed for it by its neighbours that shared."""
        def answer(secure: SecureRound) -> SecAggInbox | None:
            if secure.sharers is None:
                return None
            sharers = set(secure.sharers)
            return SecAggInbox(ready=True, shares={s: secure.shares[s][device_id]
                                                   for s in secure.neighbourhoods[device_id]
                                                   if s != device_id and s in sharers})
        return await self._held(round_id, device_id, wait_s, answer, SecAggInbox(ready=False))

    async def unmask_plan(self, round_id: int, device_id: str, wait_s: float) -> SecAggUnmaskPlan:
        """Stage 4's question for ``device_id``, once uploads closed: the survivors and the dropped
        devices of its neighbourhood."""
        return await self._held(round_id, device_id, wait_s,
                                lambda secure: secure.plans.get(device_id),
                                SecAggUnmaskPlan(ready=False))

    async def _held(self, round_id: int, device_id: str, wait_s: float,
                    answer: Callable[[SecureRound], Answer | None], not_yet: Answer) -> Answer:
        """``answer`` of the attempt's stages once it is not None, held up to ``wait_s`` (at most
        :data:`MAX_STAGE_WAIT_S`); ``not_yet`` after that."""
        hold = min(max(wait_s, 0.0), MAX_STAGE_WAIT_S) if math.isfinite(wait_s) else 0.0
        until = time.monotonic() + hold
        while True:
            _, secure = self._secure(round_id, device_id)
            ready = answer(secure)
            if ready is not None:
                return ready
            remaining = until - time.monotonic()
            if remaining <= 0:
                return not_yet
            event = secure.stage_closed
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                pass


def _still_in(fed_round: FedRound) -> set[str]:
    return set(fed_round.assignments) - set(fed_round.excluded)


def keys_in(fed_round: FedRound) -> bool:
    """Whether every device still in the attempt sent its keys (stage 1 can close)."""
    assert fed_round.secure is not None
    return _still_in(fed_round) <= set(fed_round.secure.keys)


def shares_in(fed_round: FedRound) -> bool:
    """Whether every device still in the attempt sent its shares (stage 2 can close)."""
    assert fed_round.secure is not None
    return _still_in(fed_round) <= set(fed_round.secure.shares)


def answers_in(fed_round: FedRound) -> bool:
    """Whether every survivor answered the unmasking stage (stage 4 can close)."""
    secure = fed_round.secure
    assert secure is not None and secure.plan is not None
    return set(secure.plan.survivors) <= set(secure.answers)


def close_key_stage(core: RunCore, fed_round: FedRound) -> None:
    """Close stage 1: the devices still in the attempt that sent no keys are taken out, the others
    are the roster, laid out in neighbourhoods (a fresh random ring from the operating system's
    randomness with ``neighbours``); a roster smaller than its threshold takes every device out."""
    secure = fed_round.secure
    assert secure is not None
    settings = core.config.secure_aggregation
    core.exclude(fed_round, _still_in(fed_round) - set(secure.keys), "secure aggregation: sent no keys in time")
    secure.roster = {d: secure.keys[d] for d in sorted(_still_in(fed_round))}
    secure.neighbourhoods = neighbourhoods(list(secure.roster), settings.neighbours, random.SystemRandom())
    sizes = [len(n) for n in secure.neighbourhoods.values()]
    size, secure.largest_neighbourhood = (min(sizes), max(sizes)) if sizes else (0, 0)
    secure.threshold = settings.threshold if settings.threshold is not None else majority_threshold(size)
    secure.splits = masked_splits({d: fed_round.assignments[d].split_point for d in secure.roster}, secure.threshold,
                                  secure.neighbourhoods)
    if len(secure.roster) < max(2, secure.threshold):
        core.exclude(fed_round, secure.roster, f"secure aggregation: {len(secure.roster)} devices sent keys, "
                                               f"below the threshold {secure.threshold}")
    _close_stage(secure)


def close_share_stage(core: RunCore, fed_round: FedRound) -> None:
    """Close stage 2: the devices still in the attempt that sent no shares are taken out; fewer
    sharers than the threshold take every device out; then the devices fewer than the threshold
    of whose neighbourhood shared (their secrets could never be rebuilt), or mask their deepest
    masked block (its sum would be over too few: ``shared.secagg.masks.unprotected``), are taken
    out, until none is left short. The others are the sharers."""
    secure = fed_round.secure
    assert secure is not None
    core.exclude(fed_round, _still_in(fed_round) - set(secure.shares), "secure aggregation: sent no shares in time")
    if len(_still_in(fed_round)) < secure.threshold:
        core.exclude(fed_round, _still_in(fed_round), f"secure aggregation: {len(_still_in(fed_round))} devices "
                                                      f"shared, below the threshold {secure.threshold}")
    while True:
        still = _still_in(fed_round)
        short = _short_of(still, still, secure)
        bare = set(unprotected(secure.splits, secure.threshold, secure.neighbourhoods, still)) - short
        if not short and not bare:
            break
        core.exclude(fed_round, short, f"secure aggregation: fewer than {secure.threshold} of its neighbourhood "
                                       "shared their secrets")
        core.exclude(fed_round, bare, f"secure aggregation: fewer than {secure.threshold} of its neighbourhood that "
                                      "shared mask its deepest masked block")
    secure.sharers = sorted(_still_in(fed_round))
    _close_stage(secure)


def _short_of(devices: Iterable[str], among: set[str], secure: SecureRound) -> set[str]:
    """The ``devices`` fewer than the threshold of whose neighbourhood (themselves included) are
    ``among`` the given ones (the sharers, the survivors)."""
    return {d for d in devices if len(among.intersection(secure.neighbourhoods[d])) < secure.threshold}


def open_unmasking_stage(core: RunCore, fed_round: FedRound, usable: list[str]) -> None:
    """Open stage 4 once uploads closed: the sharers among the ``usable`` uploaders (still in, and
    in a split attempt with their group's server portion back: ``Aggregator.usable``) are the
    survivors, the other sharers dropped. When the survivors' sum must not be unmasked
    (:func:`_unmasking_refusal`), every survivor is taken out instead (the attempt fails and the
    round is retried) and no share is asked for."""
    secure = fed_round.secure
    assert secure is not None and secure.sharers is not None
    survivors = [d for d in secure.sharers if d in usable]
    refusal = (_unmasking_refusal(secure, secure.sharers, survivors, core.config.deadlines.min_participants)
               if survivors else None)
    if refusal is not None:
        core.exclude(fed_round, survivors, f"secure aggregation: {refusal}")
        survivors = []
    surviving = set(survivors)
    secure.plan = SecAggUnmaskPlan(ready=True, survivors=survivors,
                                   dropped=[d for d in secure.sharers if d not in surviving])
    dropped = set(secure.plan.dropped)
    secure.plans = {device: SecAggUnmaskPlan(ready=True, survivors=[d for d in hood if d in surviving],
                                             dropped=[d for d in hood if d in dropped])
                    for device, hood in secure.neighbourhoods.items()}
    _close_stage(secure)


def _unmasking_refusal(secure: SecureRound, sharers: list[str], survivors: list[str], quorum: int) -> str | None:
    """Why the ``survivors``' sum (of the ``sharers``) must not be unmasked, or None:
    - fewer survivors than the ``quorum`` (``deadlines.min_participants``): the attempt fails
      whatever the sum, and its retry trains the same updates again (the batches are drawn from
      the logical round), so a sum unmasked now would give the Fed Server, beside the retry's, the
      difference of two sums of the same updates: a device's own where they differ by one;
    - a survivor's block that fewer than the threshold of its neighbourhood's survivors uploaded
      (``shared.secagg.masks.unprotected``): its sum would be over too few devices;
    - a sharer's neighbourhood with fewer survivors than the threshold: its secrets cannot be
      rebuilt, and its survivors would refuse to answer (``DeviceSecrets.unmask``)."""
    surviving, threshold = set(survivors), secure.threshold
    if len(survivors) < quorum:
        return (f"{len(survivors)} devices survived, below the quorum of {quorum} (deadlines.min_participants): "
                "the sum is not unmasked")
    bare = unprotected(secure.splits, threshold, secure.neighbourhoods, surviving)
    if bare:
        return (f"block {secure.splits[bare[0]] - 1} of {short_list(bare)} was uploaded by fewer than {threshold} surviving "
                "devices of its neighbourhood")
    short = sorted(_short_of(sharers, surviving, secure))
    if short:
        return (f"fewer than {threshold} devices survived in the neighbourhood of {short_list(short)}, whose secrets "
                "cannot be rebuilt")
    return None


def _close_stage(secure: SecureRound) -> None:
    """Wake the stage's long polls; the next stage waits on a fresh event."""
    secure.stage_closed.set()
    secure.stage_closed = asyncio.Event()
