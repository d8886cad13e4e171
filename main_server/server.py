"""The Main Server's logic apart from its HTTP routes: which round is open, and the uploads.

:class:`MainServer` keeps the open round (a newer plan replaces it, an older one of the same run
is refused), routes joins and steps to it after the stale-round check, and builds each finished
group's server portion for the Fed Server. It knows nothing of HTTP: the portion goes to the sender
it was given (the app's :class:`~main_server.portion_upload.FedServerPortions`), and it raises the
domain errors of ``shared/errors.py``, which ``http_api/server.py`` maps to status codes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from main_server.metrics import MainMetrics
from main_server.group import Group
from main_server.group_round import GroupRound
from shared.auth import Auth, device_bearer_token
from shared.errors import Conflict, Invalid, NotAllowed
from shared.round_label import round_label
from shared.machine import compute_workers
from shared.recording import Recording
from shared.schemas import (
    Ack, BackwardRequest, BackwardResponse, Departures, ForwardRequest, ForwardResponse, JoinRequest, JoinResponse,
    RoundPlan, RoundWatch, ServerPortionUpload, StepRequest, StepResponse, WireTensor,
)
from shared.wire import encode_state, encode_tensor

log = logging.getLogger("main_server")

#: Sends a finished group's portion to the Fed Server and returns the bytes it took; raises when
#: the portion was not delivered (:meth:`main_server.portion_upload.FedServerPortions.send`).
SendPortion = Callable[[ServerPortionUpload], Awaitable[int]]


@dataclass
class MainServerSettings:
    fed_server_url: str
    max_plan_bytes: int = 512 << 20
    max_step_bytes: int = 64 << 20
    max_join_bytes: int = 64 << 10
    upload_retries: int = 5
    auth: Auth = field(default_factory=Auth)   # no service secret: open (docs/security.md)
    ca_file: str | None = None                 # CA bundle to verify the Fed Server's HTTPS certificate
    torch_device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where groups train
    model: str | None = None                   # the operator's --model: the only import path a plan may name
    loss: str | None = None                    # the operator's --loss: the only import-path loss a plan may name
    # Group steps trained at once (--train-workers), each on the process's torch threads; None:
    # shared.machine.compute_workers(). Not asyncio's default executor (up to cores + 4 threads): more steps
    # at once than cores only share the cores, each step taking longer (benchmarks/README.md,
    # "mainserver").
    train_workers: int | None = None
    #: ``--record-received``: keep what devices send (honest-but-curious, for studying what a
    #: server learns; shared/recording.py). None: nothing is kept.
    recording: Recording | None = None


class MainServer:
    """Holds the current round and hands finished groups' server portions to ``send_portion``.

    Every round's group steps train in this server's training workers (``train_workers`` threads,
    started on first use), first ready, first trained.
    """

    def __init__(self, settings: MainServerSettings, send_portion: SendPortion, metrics: MainMetrics | None = None) -> None:
        self.settings = settings
        self.send_portion = send_portion
        self.metrics = metrics if metrics is not None else MainMetrics(self)
        self.round: GroupRound | None = None
        self.stopping = False   # the server is stopping: watch streams end (stop_watching)
        # The open round's participants by their device token (authentication on): who calls is
        # known from the header, before a join's or step's body is read (:meth:`caller`).
        self._participant_tokens: dict[str, str] = {}
        self.trainers = ThreadPoolExecutor(settings.train_workers or compute_workers(),
                                           thread_name_prefix="main-train")

    def current(self, round_id: int) -> GroupRound:
        """The open round if it is ``round_id``; Conflict for none open or a stale round id."""
        if self.round is None:
            raise Conflict("no round is open at the Main Server")
        if round_id != self.round.round_id:
            raise Conflict(f"round {round_id} is stale: the open round is {self.round.round_id}")
        return self.round

    def open_round(self, plan: RoundPlan) -> None:
        """Open the plan's round, replacing (abandoning) the open one unless the plan is older."""
        if self.round is not None and plan.run_id == self.round.plan.run_id and plan.round_id < self.round.round_id:
            raise Conflict(f"plan for round {plan.round_id} is older than the open round {self.round.round_id}")
        # validates the plan before anything is replaced
        new = GroupRound(plan, self.upload_portion, self.metrics, self.settings.torch_device, model_ref=self.settings.model,
                         executor=self.trainers, loss_ref=self.settings.loss, recording=self.settings.recording)
        if self.round is not None:
            self.round.abandon()
        self.round = new
        auth = self.settings.auth
        self._participant_tokens = {auth.device_token(plan.run_id, p.device_id, p.token_nonce): p.device_id
                                    for p in plan.participants if p.token_nonce is not None} if auth.enabled else {}
        self.metrics.round_opened()
        log.info("%s opened: %d participants", round_label(plan.round_index, plan.round_id), len(plan.participants))

    def caller(self, round_id: int, headers: Mapping[str, str]) -> str | None:
        """The participant of open round ``round_id`` whose device token ``headers`` carry, known
        before the request's body is read: Conflict for a stale round, Unauthenticated without a
        token, NotAllowed for a token of no participant (the plan carries each participant's
        token nonce, docs/security.md). None with authentication off."""
        self.current(round_id)
        if not self.settings.auth.enabled:
            return None
        token = device_bearer_token(headers)
        device_id = self._participant_tokens.get(token)
        if device_id is None:
            raise NotAllowed(f"the token is not the current token of a participant of round {round_id}")
        return device_id

    async def join(self, round_id: int, req: JoinRequest) -> JoinResponse:
        """A device joins round ``round_id``; answered once the round's groups are formed."""
        return await self.current(round_id).join(req)

    def depart(self, round_id: int, departures: Departures) -> Ack:
        """Participants the Fed Server took out of round ``round_id``: the round stops waiting for
        them (:meth:`GroupRound.depart`)."""
        if departures.round_id != round_id:
            raise Invalid(f"body round_id {departures.round_id} does not match the path's round {round_id}")
        self.current(round_id).depart(departures.devices)
        return Ack(detail=f"{len(departures.devices)} device(s) left round {round_id}")

    async def step(self, round_id: int, req: StepRequest) -> StepResponse:
        """One device step of round ``round_id``; answered with its dfx after the group's barrier."""
        outcome = await self.current(round_id).step(req)
        assert outcome.result.loss is not None   # a step whose copy computes the loss
        return StepResponse(
            dfx=WireTensor(**encode_tensor(outcome.result.dfx)), loss=outcome.result.loss,
            wait_s=outcome.wait_s, server_s=outcome.server_s,
        )

    async def forward(self, round_id: int, req: ForwardRequest) -> ForwardResponse:
        """U-shaped mode, a step's first half of round ``round_id``: the middle's output for the
        device's rows after the group's barrier."""
        outcome = await self.current(round_id).forward(req)
        return ForwardResponse(output=WireTensor(**encode_tensor(outcome.result.output)),
                               loss_weight=outcome.result.loss_weight, wait_s=outcome.wait_s, server_s=outcome.server_s)

    async def backward(self, round_id: int, req: BackwardRequest) -> BackwardResponse:
        """U-shaped mode, a step's second half of round ``round_id``: the device's dfx once every
        gradient of its group's step has arrived and the copy has stepped."""
        outcome = await self.current(round_id).backward(req)
        return BackwardResponse(dfx=WireTensor(**encode_tensor(outcome.result.dfx)), wait_s=outcome.wait_s,
                                server_s=outcome.server_s)

    async def watch(self, state: GroupRound, heartbeat_s: float) -> AsyncIterator[RoundWatch]:
        """The round's watch stream: ``open`` every ``heartbeat_s`` while it runs, and at once
        whenever a member is dropped, then ``done`` once every group's upload ended, or ``replaced``
        by a newer plan. Every line carries the members dropped so far, with why; ``done`` also the
        groups whose portion was not delivered. The Fed Server holds one per replica and round: it
        excludes those members at once, and a stream that ends without its last line, or falls
        silent, tells it the replica is gone, without polling (docs/api.md): as it is once this
        server stops (:meth:`stop_watching`)."""
        while not state.closed.is_set():
            if self.stopping:
                return
            changed = state.changed()   # taken before the line: a drop while it is sent wakes us
            yield RoundWatch(round_id=state.round_id, state="open", dropped=dict(state.dropped))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), heartbeat_s)
        yield RoundWatch(round_id=state.round_id, state="replaced" if state.abandoned else "done",
                         dropped=dict(state.dropped), undelivered=sorted(state.undelivered))

    def stop_watching(self) -> None:
        """The server is stopping: end every watch stream now, without its last line (the Fed
        Server then plans around this replica), instead of holding the stop for the shutdown grace."""
        self.stopping = True
        if self.round is not None:
            self.round.announce()

    def status(self) -> dict:
        """A JSON-friendly view of the open round for ``/v1/status``."""
        return {"round": self.round.summary() if self.round else None}

    async def upload_portion(self, state: GroupRound, group: Group) -> None:
        """Hand a finished group's server portion to ``send_portion``; its failure reaches the
        caller (the round reports the group as undelivered)."""
        upload = ServerPortionUpload(
            run_id=state.plan.run_id, round_id=state.round_id, group_id=group.group_id,
            members=sorted(group.done), dropped=sorted(group.dropped),
            absent=sorted(set(state.participants) - set(state.joins.joined)), start_block=group.trainer.start,
            weights=group.trainer.wire_state(), label_distance=group.distance,
            member_weights={d: encode_state(s) for d, s in group.trainer.member_states(sorted(group.done)).items()},
            steps=group.trainer.steps, train_time_s=group.train_time_s,
        )
        group.trainer.release()   # the upload holds the encoded portion: the copy is not needed again
        size = await self.send_portion(upload)
        log.info("round %d group %d upload done (%d bytes)", state.round_id, group.group_id, size)
