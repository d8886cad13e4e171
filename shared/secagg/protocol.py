"""The stages of secure aggregation for one attempt, as pure logic both sides run: a device's
(:class:`DeviceSecrets`: keys, shares, masking, unmasking answers) and the Fed Server's
(:func:`rebuild_secrets`, :func:`unmasked_sum`). The HTTP calls are the services'
(``device_agent/secure_aggregation.py``, ``fed_server/secure_stages.py``); docs/privacy.md
describes the protocol.

A device shares its secrets and masks with its neighbours (``shared.secagg.graph``: SecAgg+'s
sparse graph, or every other device). What it is served as its roster is its neighbourhood: its
neighbours' keys and its own. A share is the share of the owner's 16-byte mask seed followed by the
share of its 32-byte mask key (each Shamir-shared, :data:`SHARE_BYTES` each), and carries the
recipient's index: its position in the owner's sorted neighbourhood, from 1.

The owner commits to what it dealt (``shared.secagg.crypto.commitment``): to its seed, and to each
share, the commitments to a neighbour's two shares travelling after the sealed share, in the clear.
The recipient checks its shares against them when it opens them; the Fed Server checks each share
an unmasking answer carries against them, and each secret it rebuilds against the seed's
commitment or the public mask key. So a device that answers with a wrong share is refused by name,
and one that dealt shares of no single secret is named, where either would otherwise have left the
masks in the sum or failed the attempt for everyone."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.secagg.crypto import (
    DIGEST_BYTES, MASK_PURPOSE, NONCE_BYTES, SHARE_PURPOSE, TAG_BYTES, ShareError, agree, commitment, new_private_key,
    open_sealed, private_key, public_key, seal, share_associated,
)
from shared.secagg.encoding import encode
from shared.secagg.masks import BlockLayout, Words, add_masks, remove_masks, well_held
from shared.secagg.shamir import SHARE_BYTES, combine_secret, split_secret
from shared.short_list import short_list

SEED_BYTES = 16
KEY_BYTES = 32
#: A sealed share's length: the nonce, the two shares (of the seed, of the mask key) and the tag.
SEALED_SHARE_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + TAG_BYTES
#: The commitments to a neighbour's two shares (of the seed, of the mask key), one after the other.
COMMITMENTS_BYTES = 2 * DIGEST_BYTES
#: A dealt share's length: the sealed share, then the commitments to the two shares it holds.
DEALT_SHARE_BYTES = SEALED_SHARE_BYTES + COMMITMENTS_BYTES
#: The two secrets a device shares, in the order of a share's parts: its mask seed, its mask key.
SECRETS = ("seed", "key")
#: Public keys by device: (mask key, share key).
PublicKeys = Mapping[str, tuple[bytes, bytes]]


def share_commitment(run_id: str, round_id: int, owner: str, holder: str, part: int, share: bytes) -> bytes:
    """``owner``'s commitment to the share of its seed (``part`` 0) or mask key (1) it dealt ``holder``."""
    return commitment(run_id, round_id, owner, f"{SECRETS[part]} share for {holder}", share)


def share_indices(neighbourhood: Sequence[str]) -> dict[str, int]:
    """The share index of each device of an owner's neighbourhood: its position in sorted order,
    from 1."""
    return {device: i for i, device in enumerate(sorted(neighbourhood), 1)}


@dataclass
class DeviceSecrets:
    """One device's secrets for one attempt of run ``run_id``, fresh for every attempt: its mask
    seed, its mask and share key pairs, and the shares its peers sealed for it."""

    device_id: str
    run_id: str
    round_id: int
    seed: bytes = field(default_factory=lambda: os.urandom(SEED_BYTES))
    mask_private: bytes = field(default_factory=new_private_key)
    share_private: bytes = field(default_factory=new_private_key)
    #: Owner -> (its seed's share, its mask key's share) held for it, once the inbox is opened.
    held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    #: The keys agreed with the peers' public keys, by (purpose, public key): the share key sealed
    #: with is the one opened with, and the mask key checked before sharing is the one masked with,
    #: so each X25519 agreement is made once an attempt (most of a device's share stage otherwise).
    agreed: dict[tuple[bytes, bytes], bytes] = field(default_factory=dict, repr=False)
    #: The roster's threshold, once the shares are sealed: the fewest devices of the neighbourhood
    #: (this one included) it masks with, and the fewest survivors it answers the unmasking for.
    threshold: int = field(default=0, init=False)
    #: The commitments to the two shares it dealt itself, once the shares are sealed (sent with them).
    own_commitments: bytes = field(default=b"", init=False)

    def __post_init__(self) -> None:
        # The key objects, built once: building one from its raw bytes costs as much as an
        # agreement, and a device makes two agreements with every neighbour.
        self._private = {MASK_PURPOSE: private_key(self.mask_private), SHARE_PURPOSE: private_key(self.share_private)}

    def public_keys(self) -> tuple[bytes, bytes]:
        """(mask key, share key): what the first stage sends."""
        return public_key(self._private[MASK_PURPOSE]), public_key(self._private[SHARE_PURPOSE])

    def seed_commitment(self) -> bytes:
        """The commitment to its seed, sent with its shares: what the Fed Server checks the seed it
        rebuilds against."""
        return commitment(self.run_id, self.round_id, self.device_id, "seed", self.seed)

    def check_roster(self, roster: PublicKeys) -> None:
        """SecAgg+'s checks of a roster before any share is sealed (as Flower's client makes them):
        it holds this device's own keys, and no public key twice. Two devices with one key would
        agree one pairwise mask with a device between them in sort order, which it adds for one and
        subtracts for the other: its upload would carry its own mask alone, which the unmasking
        removes. ShareError naming the devices."""
        if roster.get(self.device_id) != self.public_keys():
            raise ShareError(f"the roster does not hold {self.device_id!r} with its own public keys")
        owners: dict[bytes, list[str]] = {}
        for device, pair in roster.items():
            for key in set(pair):
                owners.setdefault(key, []).append(device)
        repeated = sorted({d for devices in owners.values() if len(devices) > 1 for d in devices}
                          | {d for d, (mask_key, share_key) in roster.items() if mask_key == share_key})
        if repeated:
            raise ShareError(f"the roster repeats a public key among {repeated}: their pairwise masks could cancel")

    def _agree(self, peer_public: bytes, purpose: bytes) -> bytes:
        """The key agreed with ``peer_public`` for ``purpose`` (:data:`MASK_PURPOSE` with this
        device's mask key, :data:`SHARE_PURPOSE` with its share key), made once. ShareError for a
        public key that agrees on nothing."""
        key = (purpose, peer_public)
        if key not in self.agreed:
            self.agreed[key] = agree(self._private[purpose], peer_public, purpose)
        return self.agreed[key]

    def seal_shares(self, roster: PublicKeys, threshold: int) -> dict[str, bytes]:
        """The second stage: the seed and mask key split into one share per device of ``roster``
        (this device's neighbourhood), any ``threshold`` of which rebuild them, each sealed for its
        recipient with the key agreed with its share key and followed by the commitments to its two
        shares (:data:`DEALT_SHARE_BYTES`; the device's own share is kept, not sent, its
        commitments in :attr:`own_commitments`). ShareError for a roster that :meth:`check_roster` refuses or a key that agrees on
        nothing; ValueError when the threshold does not fit."""
        self.check_roster(roster)
        if not 2 <= threshold <= len(roster):
            raise ValueError(f"a threshold of {threshold} does not fit a roster of {len(roster)} devices")
        self.threshold = threshold
        for device, (mask_key, share_key) in roster.items():
            if device != self.device_id:        # every key checked before any share leaves
                self._agree(mask_key, MASK_PURPOSE)
                self._agree(share_key, SHARE_PURPOSE)
        indices = share_indices(list(roster))
        seeds = split_secret(self.seed, threshold, len(roster))
        keys = split_secret(self.mask_private, threshold, len(roster))
        sealed = {}
        for device, index in indices.items():
            seed_share, key_share = seeds[index - 1], keys[index - 1]
            committed = self._commitments(self.device_id, device, seed_share, key_share)
            if device == self.device_id:
                self.held[device] = (seed_share, key_share)
                self.own_commitments = committed
                continue
            sealed[device] = seal(self._agree(roster[device][1], SHARE_PURPOSE), seed_share + key_share,
                                  share_associated(self.run_id, self.round_id, self.device_id, device)) + committed
        return sealed

    def _commitments(self, owner: str, holder: str, seed_share: bytes, key_share: bytes) -> bytes:
        """``owner``'s commitments to the two shares it dealt ``holder``."""
        return (share_commitment(self.run_id, self.round_id, owner, holder, 0, seed_share)
                + share_commitment(self.run_id, self.round_id, owner, holder, 1, key_share))

    def open_inbox(self, roster: PublicKeys, inbox: Mapping[str, bytes]) -> list[str]:
        """Open the shares the peers dealt this device (each sealed, then committed to); the devices
        it masks with (those whose shares it holds, itself included). ShareError naming the sender
        whose share does not verify or is not the one it committed to (the Fed Server would refuse
        this device's answer with it as false), or when fewer than the threshold shared (SecAgg+'s
        check: its update would be hidden by too few pairwise masks)."""
        for sender, dealt in sorted(inbox.items()):
            if sender not in roster or sender == self.device_id:
                raise ShareError(f"a share from {sender!r}, who is not another device of the roster")
            sealed, committed = dealt[:-COMMITMENTS_BYTES], dealt[-COMMITMENTS_BYTES:]
            try:
                piece = open_sealed(self._agree(roster[sender][1], SHARE_PURPOSE), sealed, share_associated(self.run_id, self.round_id, sender, self.device_id))
            except ShareError as exc:
                raise ShareError(f"the share from {sender!r} {exc}") from None
            if len(piece) != 2 * SHARE_BYTES:
                raise ShareError(f"the share from {sender!r} has {len(piece)} bytes, not {2 * SHARE_BYTES}")
            seed_share, key_share = piece[:SHARE_BYTES], piece[SHARE_BYTES:]
            if self._commitments(sender, self.device_id, seed_share, key_share) != committed:
                raise ShareError(f"the share from {sender!r} is not the one it committed to")
            self.held[sender] = (seed_share, key_share)
        if len(self.held) < self.threshold:
            raise ShareError(f"{len(self.held)} devices of {self.device_id!r}'s neighbourhood shared, itself included, "
                             f"below the threshold {self.threshold}")
        return sorted(self.held)

    def mask(self, update: Mapping[str, np.ndarray], weight: float, fraction_bits: int, value_range: float,
             layout: BlockLayout, roster: PublicKeys, partners: Sequence[str], splits: Mapping[str, int]) -> Words:
        """The third stage: ``update`` (float64 by entry: this device's blocks ``[0, split)``)
        clipped to ``value_range`` per entry, weighed by ``weight``, encoded in fixed point and
        masked with this device's own mask and the pairwise mask of every other device of
        ``partners`` on the blocks both hold (``splits``: each roster device's split point).
        ShareError when fewer than the threshold of ``partners`` (itself included) mask its deepest
        block (``shared.secagg.masks.masked_splits``): its sum would be over too few devices."""
        own = splits[self.device_id]
        if own > well_held(splits, {*partners, self.device_id}, self.threshold):
            raise ShareError(f"block {own - 1} of {self.device_id!r} is masked by fewer than {self.threshold} of the "
                             "devices it masks with, itself included")
        words = {k: encode(np.clip(v, -value_range, value_range) * weight, fraction_bits, weight * value_range)
                 for k, v in update.items()}
        return add_masks(words, layout, self.device_id, splits[self.device_id], self.seed,
                         {p: (self._agree(roster[p][0], MASK_PURPOSE), splits[p]) for p in partners if p != self.device_id})

    def unmask(self, survivors: Sequence[str], dropped: Sequence[str]) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """The last stage: the shares this device holds of the survivors' seeds and of the dropped
        devices' mask keys. ShareError for a device named in both (its update would be readable),
        or fewer survivors of its neighbourhood than the threshold (SecAgg+'s check: the sum over
        them is not one the threshold allows)."""
        both = set(survivors) & set(dropped)
        if both:
            raise ShareError(f"{sorted(both)} named both as survivors and as dropped")
        surviving = len(self.held.keys() & set(survivors))
        if surviving < self.threshold:
            raise ShareError(f"{surviving} devices of {self.device_id!r}'s neighbourhood survived, "
                             f"below the threshold {self.threshold}")
        return ({d: self.held[d][0] for d in survivors if d in self.held},
                {d: self.held[d][1] for d in dropped if d in self.held})


class DealingError(ValueError):
    """Shares of ``owners`` that their commitments vouch for rebuild no secret they committed to:
    each dealt shares of no single secret, or committed to another seed than it shared."""

    def __init__(self, owners: Sequence[str]) -> None:
        super().__init__(f"the shares of {short_list(owners)} rebuild no secret they committed to: each dealt shares of no "
                         "single secret")
        self.owners = list(owners)


@dataclass(frozen=True)
class Committed:
    """What the devices of attempt ``round_id`` of run ``run_id`` committed to, as the Fed Server
    holds it: each one's seed (:meth:`DeviceSecrets.seed_commitment`) and its public mask key."""

    run_id: str
    round_id: int
    seeds: Mapping[str, bytes]
    mask_keys: Mapping[str, bytes]

    def holds(self, owner: str, part: int, secret: bytes) -> bool:
        """Whether ``secret`` is ``owner``'s seed (``part`` 0) or mask key (1) as it committed to it."""
        if part == 0:
            return commitment(self.run_id, self.round_id, owner, "seed", secret) == self.seeds.get(owner)
        return public_key(secret) == self.mask_keys.get(owner)


def rebuild_secrets(answers: Mapping[str, tuple[Mapping[str, bytes], Mapping[str, bytes]]],
                    neighbourhoods: Mapping[str, Sequence[str]], survivors: Sequence[str], dropped: Sequence[str],
                    threshold: int, committed: Committed) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The Fed Server's side of the last stage: from each answering device's (seed shares, key
    shares), the survivors' seeds and the dropped devices' mask keys, an owner's shares indexed in
    its neighbourhood. DealingError naming every owner whose shares rebuild no secret of its size,
    or one other than it ``committed`` to (the answers' shares were checked against its commitments as they came: the
    owner dealt shares of no single secret, or committed to another seed), before any ValueError
    for a secret of which fewer than ``threshold`` shares came back (so a device that misdealt is
    named whatever else failed).
    Each secret is rebuilt from exactly ``threshold`` of its shares (the lowest indices), which
    determine it: interpolating more rebuilds the same secret at a cost quadratic in the shares,
    which is most of the Fed Server's work in a secure round (benchmarks/README.md, part (l))."""
    def rebuilt(owner: str, part: int, shares: Mapping[int, bytes]) -> bytes | None:
        """The secret ``shares`` rebuild, if it is the one ``owner`` committed to."""
        try:
            secret = combine_secret(dict(sorted(shares.items())[:threshold]), (SEED_BYTES, KEY_BYTES)[part])
        except ValueError:
            return None
        return secret if committed.holds(owner, part, secret) else None

    secrets: dict[tuple[str, int], bytes | None] = {}
    short = []
    for owner, part in [*((d, 0) for d in survivors), *((d, 1) for d in dropped)]:
        # Its neighbours' answers only (not every answer's): the work stays linear in the devices.
        shares = {index: answers[who][part][owner] for who, index in share_indices(neighbourhoods[owner]).items()
                  if who in answers and owner in answers[who][part]}
        if len(shares) < threshold:
            short.append(f"{len(shares)} shares of {owner!r}'s secret came back, below the threshold {threshold}")
        else:
            secrets[owner, part] = rebuilt(owner, part, shares)
    misdealt = [owner for (owner, _), secret in secrets.items() if secret is None]
    if misdealt:
        raise DealingError(misdealt)
    if short:
        raise ValueError(short[0])
    return ({o: s for (o, p), s in secrets.items() if p == 0 and s is not None},
            {o: s for (o, p), s in secrets.items() if p == 1 and s is not None})


def unmasked_sum(masked: Mapping[str, Words], layout: BlockLayout, seeds: Mapping[str, bytes],
                 dropped_keys: Mapping[str, bytes], mask_keys: Mapping[str, bytes],
                 neighbourhoods: Mapping[str, Sequence[str]], splits: Mapping[str, int]) -> Words:
    """The sum of the survivors' encoded updates (uint64 by entry), each entry over the survivors
    that hold it (``splits``: each roster device's split point): their masked words summed modulo
    2**64, their own masks and the pairwise masks each dropped device left in its surviving
    neighbours' words removed. ``mask_keys``: every roster device's public mask key."""
    survivors = sorted(masked)
    surviving = set(survivors)
    total: Words = {}
    for device in survivors:
        for key, words in masked[device].items():
            if key in total:
                np.add(total[key], words, out=total[key])
            else:
                total[key] = np.array(words, dtype=np.uint64)
    return remove_masks(total, layout, splits, seeds, dropped_keys,
                        {d: [s for s in neighbourhoods[d] if s in surviving] for d in dropped_keys}, mask_keys)


def words_to_state(words: Words) -> dict[str, torch.Tensor]:
    """Masked words as the tensors an upload carries: int64, the same 64 bits."""
    return {k: torch.from_numpy(np.ascontiguousarray(v).view(np.int64).copy()) for k, v in words.items()}


def state_to_words(state: Mapping[str, torch.Tensor]) -> Words:
    """The masked words an upload's int64 tensors carry."""
    return {k: v.numpy().view(np.uint64) for k, v in state.items()}


def masked_layout(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a masked upload of a model with ``state`` must hold: every entry, int64, of its shape."""
    return {k: torch.empty(v.shape, dtype=torch.int64) for k, v in state.items()}


__all__ = ["Committed", "DealingError", "DeviceSecrets", "ShareError", "masked_layout", "rebuild_secrets", "share_commitment",
           "share_indices", "state_to_words", "unmasked_sum", "words_to_state"]
