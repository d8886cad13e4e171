"""A device's side of secure aggregation (``TaskResponse.secure_aggregation``; docs/privacy.md):
the key and share stages before training, the shares sealed for it and the masked upload's weights
after training, and the unmasking answer after the upload. The cryptography is
``shared.secagg.protocol``'s; this module only carries it to the Fed Server (its own client, or its
agent's batches: :mod:`device_agent.secure_batches`) and waits on its stages (long polls, never a
timer)."""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from device_agent.api import SecureChannel, StageAnswer
from device_agent.task_expired import TaskExpired
from shared.errors import Invalid
from shared.privacy.noise import add_noise, distributed_noise_std
from shared.schemas import (
    PrivacyTerms, SecAggInbox, SecAggKeys, SecAggRoster, SecAggShares, SecAggUnmask, SecAggUnmaskPlan, SecureTerms,
)
from shared.secagg.masks import BlockLayout
from shared.secagg.crypto import ShareError
from shared.secagg.protocol import DeviceSecrets, PublicKeys, words_to_state
from shared.wire import encode_state

#: The longest one stage's long poll is asked to hold (the Fed Server holds at most 30 s).
STAGE_WAIT_S = 30.0


@dataclass
class SecureSession:
    """One attempt's secure aggregation on a device once it sent its shares: its secrets and the
    roster's public keys."""

    fed: SecureChannel
    secrets: DeviceSecrets
    terms: SecureTerms
    roster: PublicKeys
    deadline: float
    #: The fewest survivors whose sum the Fed Server can unmask (the roster's threshold).
    threshold: int
    #: The split point of each device of the roster: the blocks it masks.
    splits: dict[str, int]

    @property
    def round_id(self) -> int:
        return self.secrets.round_id

    def masked_weights(self, state: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor], weight: float,
                       layout: BlockLayout, privacy: PrivacyTerms | None = None) -> dict:
        """The upload's weights: the change from ``start`` to ``state`` of every entry of the
        blocks the roster gives this device to mask (those of its portion that enough devices
        hold), weighed by ``weight`` (the device's sample count), encoded and masked with the
        devices whose shares it holds (:meth:`open_inbox`), as int64 tensors on the wire.
        With distributed noise (``privacy.noise_multiplier``) the change weighs 1 and carries this
        device's share of the noise: N(0, (z C)^2 / threshold) on every entry, drawn from the
        operating system's randomness. Invalid for a change with a NaN or infinite entry (a
        diverged training), which the fixed point would turn into an extreme value no check could
        see in the sum: the device withdraws, as a plain upload of it would be refused."""
        partners = self.open_inbox()
        masked = layout.held_keys(self.splits[self.secrets.device_id])
        update = {k: state[k].double() - start[k].double() for k in masked}
        broken = sorted(k for k, v in update.items() if not bool(torch.isfinite(v).all()))
        if broken:
            raise Invalid(f"the update of {self.secrets.device_id} has NaN or infinite entries in {broken[:3]}: "
                          "not masked")
        if privacy is not None and privacy.noise_multiplier is not None:
            weight = 1.0
            update = add_noise(update, distributed_noise_std(privacy.noise_multiplier, privacy.clip_norm,
                                                             self.threshold))
        words = self.secrets.mask({k: v.cpu().numpy() for k, v in update.items()}, weight, self.terms.fraction_bits,
                                  self.terms.value_range, layout, self.roster, partners, self.splits)
        return encode_state(words_to_state(words))

    def open_inbox(self) -> list[str]:
        """The share stage's result: wait for the shares this device's neighbours sealed for it
        and open them; the devices it masks with (those whose shares it holds, itself included).
        ShareError naming a sender whose share does not verify; TaskExpired past the deadline."""
        inbox = _stage(self.fed, self.round_id, "inbox", self.secrets.device_id, SecAggInbox, self.deadline)
        return self.secrets.open_inbox(self.roster, inbox.shares)

    def answer_unmasking(self) -> None:
        """The last stage, after the upload: wait for the unmasking question and send the shares
        this device holds of the survivors' seeds and the dropped devices' mask keys. The question
        comes once uploads close, which may be at the round deadline (one device that never
        uploads), and later in a split run (the Fed Server may first wait on its replicas): so the
        device waits past its task's deadline, until the Fed Server asks or refuses it (the attempt
        closed without unmasking, 409). A survivor that does not answer fails the unmasking for
        its neighbourhood and sits out the next attempts."""
        device = self.secrets.device_id
        plan = _stage(self.fed, self.round_id, "unmask", device, SecAggUnmaskPlan, math.inf)
        seeds, keys = self.secrets.unmask(plan.survivors, plan.dropped)
        self.fed.secagg_send(self.round_id, "unmask", SecAggUnmask(device_id=device, round_id=self.round_id,
                                                                   seed_shares=seeds, key_shares=keys))


def share_secrets(fed: SecureChannel, device_id: str, round_id: int, terms: SecureTerms, deadline: float,
                  split_point: int) -> SecureSession:
    """The key and share stages of attempt ``round_id``: send fresh public keys, wait for the
    roster, send the sealed shares. The shares sealed for this device are fetched when it masks
    its update (:meth:`SecureSession.open_inbox`): it trains meanwhile, and the share stage closes
    as the last device sends its shares, not after every device has also fetched and opened its
    own. ShareError (a ValueError) for a roster whose split points do not fit (``split_point``:
    this device's cut) or a key that agrees on nothing; TaskExpired past ``deadline``."""
    secrets = DeviceSecrets(device_id, terms.run_id, round_id)
    mask_key, share_key = secrets.public_keys()
    fed.secagg_send(round_id, "keys", SecAggKeys(device_id=device_id, round_id=round_id, mask_key=mask_key,
                                                 share_key=share_key))
    roster_answer = _stage(fed, round_id, "roster", device_id, SecAggRoster, deadline)
    roster = {d: (k.mask_key, k.share_key) for d, k in roster_answer.keys.items()}
    if set(roster_answer.splits) != set(roster) or not 1 <= roster_answer.splits.get(device_id, 0) <= split_point:
        raise ShareError(f"the roster's split points do not name exactly its devices, or give {device_id} blocks "
                         f"past its cut at {split_point}")
    shares = secrets.seal_shares(roster, roster_answer.threshold)
    fed.secagg_send(round_id, "shares", SecAggShares(device_id=device_id, round_id=round_id, shares=shares,
                                                     seed_commitment=secrets.seed_commitment(),
                                                     own_commitments=secrets.own_commitments))
    return SecureSession(fed, secrets, terms, roster, deadline, roster_answer.threshold, dict(roster_answer.splits))


def _stage(fed: SecureChannel, round_id: int, stage: str, device_id: str, model: type[StageAnswer],
           deadline: float) -> StageAnswer:
    """``stage``'s answer once the Fed Server closed it (its ``ready``), asked in long polls;
    TaskExpired past ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TaskExpired(f"secure aggregation's {stage} stage did not close before the task's deadline")
        answer = fed.secagg_ask(round_id, stage, device_id, min(STAGE_WAIT_S, remaining), model)
        if getattr(answer, "ready"):
            return answer
