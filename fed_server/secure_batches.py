"""Secure aggregation's stages for an agent's devices together: one request carries many devices'
messages, one held request asks a stage's answer for many devices.

An agent hosting a thousand devices would otherwise send a thousand key messages, hold a
thousand long polls for the roster, and so on through every stage of every attempt: on a small
host the requests alone take minutes, longer than a stage stays open. A stage closes for every
device at once, so one held question answers all of an agent's devices waiting on it.

Each device in a batch speaks with its current token from the batch's body (as in an agent's task
session: :meth:`DeviceEnrolment.check_held_token`) and is taken or refused on its own, exactly as
its own request to :class:`fed_server.secure_stages.SecureStages` would be: one device's refusal
changes nothing for the others.
"""
from __future__ import annotations

import asyncio

from fed_server.enrolment import DeviceEnrolment
from fed_server.secure_stages import SecureStage, SecureStages
from shared.errors import DomainError
from shared.schemas import AgentDevice, SecAggBatch, SecAggInbox, SecAggRoster, SecAggUnmaskPlan

#: One device's answer to a stage question, or why it was refused.
Outcome = SecAggRoster | SecAggInbox | SecAggUnmaskPlan | DomainError


class SecureBatches:
    """An agent's devices' secure aggregation messages and stage questions, each device's on its own."""

    def __init__(self, stages: SecureStages, enrolment: DeviceEnrolment) -> None:
        self.stages = stages
        self.enrolment = enrolment

    def accept(self, round_id: int, batch: SecAggBatch, auth_enabled: bool) -> dict[str, DomainError]:
        """Take each message of ``batch`` into its stage; the refused senders, each with its error."""
        tokens = {device.device_id: device.token for device in batch.devices}
        refused: dict[str, DomainError] = {}
        accepts = ([(m.device_id, lambda m=m: self.stages.accept_keys(round_id, m)) for m in batch.keys]
                   + [(m.device_id, lambda m=m: self.stages.accept_shares(round_id, m)) for m in batch.shares]
                   + [(m.device_id, lambda m=m: self.stages.accept_unmask(round_id, m)) for m in batch.unmask])
        for device_id, accept in accepts:
            try:
                self.enrolment.check_held_token(device_id, tokens[device_id], auth_enabled)
                accept()
            except DomainError as exc:
                refused[device_id] = exc
        return refused

    async def ask(self, round_id: int, stage: SecureStage, devices: list[AgentDevice], wait_s: float,
                  auth_enabled: bool) -> dict[str, Outcome]:
        """``stage``'s answer for each of ``devices``, held up to ``wait_s`` until it closes (for
        all of them: a stage closes for every device at once), or why a device was refused."""
        async def one(device: AgentDevice) -> Outcome:
            try:
                self.enrolment.check_held_token(device.device_id, device.token, auth_enabled)
                return await self.stages.ask(round_id, stage, device.device_id, wait_s)
            except DomainError as exc:
                return exc
        outcomes = await asyncio.gather(*(one(device) for device in devices))
        return {device.device_id: outcome for device, outcome in zip(devices, outcomes)}
