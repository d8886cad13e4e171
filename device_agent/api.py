"""What a device's runner needs from the two servers, as typed calls: no URLs, headers or statuses.

:class:`device_agent.device.Device` drives a device's rounds over these two interfaces; the HTTP
implementations are in :mod:`device_agent.clients`, and a unit test can hand the runner in-memory
fakes. A refusal arrives as the domain error the server raised (:mod:`shared.errors`: a
``NotFound`` from the Fed Server means it does not know this device, e.g. after a restart), and a
server that cannot be reached as :class:`Unreachable`.
"""
from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel

from shared.http_client import Cancellation

from shared.schemas import (
    AgentTaskRequest, AgentTaskResponse, BackwardRequest, BackwardResponse, EvaluationReport, ForwardRequest,
    ForwardResponse, RegistrationBatch, SecAggAnswers, SecAggBatch, SecAggBatchAck, SecAggQuestion, RegistrationBatchResponse, JoinRequest, JoinResponse, RegisterRequest, RegisterResponse, ReportRequest, RunInfo, StepRequest, StepResponse,
    TaskResponse, UpdateRequest, WeightsId, WeightsResponse, WithdrawRequest,
)


#: A secure aggregation stage's answer (``SecAggRoster``, ``SecAggInbox``, ``SecAggUnmaskPlan``).
StageAnswer = TypeVar("StageAnswer", bound=BaseModel)


class Unreachable(Exception):
    """The server did not answer (connection refused or reset, timeout), after the client's retries."""


class SecureChannel(Protocol):
    """Where a device's secure aggregation stages go: its own Fed Server client, or its agent's
    batches (:class:`device_agent.secure_batches.SecureBatches`)."""

    def secagg_send(self, round_id: int, stage: str, req: BaseModel) -> None:
        """Secure aggregation: what the device sends into ``stage`` (keys, shares, unmask) of the attempt."""

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float,
                   model: type[StageAnswer]) -> StageAnswer:
        """Secure aggregation: ``stage``'s answer (roster, inbox, unmask), held up to ``wait_s`` until it closes."""


class FedApi(SecureChannel, Protocol):
    """The Fed Server, as one device sees it."""

    def run_info(self) -> RunInfo:
        """The run's model and data spec."""

    def register(self, req: RegisterRequest) -> RegisterResponse:
        """Enrol the device; the client presents the answer's token on every later call."""

    def use_token(self, token: str | None) -> None:
        """Present ``token`` on every later call: the device's agent registered it (in a batch)."""

    def task(self, device_id: str, wait_s: float = 0.0) -> tuple[TaskResponse, int]:
        """The device's next instruction and the size of the answer in bytes (for transfer timing);
        with ``wait_s``, the server may hold a ``wait`` answer that long for work to arrive."""

    def weights(self, device_id: str, weights_id: WeightsId,
                cancel: Cancellation | None = None) -> tuple[WeightsResponse, int]:
        """The weights a task named, and the size of the answer in bytes; once ``cancel`` is set
        while they arrive, :class:`device_agent.task_expired.TaskExpired` (the task's attempt closed)."""

    def report(self, req: ReportRequest) -> None:
        """Two-phase algorithms: the post-training report."""

    def upload(self, req: UpdateRequest) -> None:
        """The round's trained portion."""

    def evaluation(self, req: EvaluationReport) -> None:
        """Federated evaluation: the global model's results on the device's held-out part."""

    def withdraw(self, req: WithdrawRequest) -> None:
        """Leave a round the device cannot contribute to, so the attempt need not wait for its upload."""


class AgentApi(Protocol):
    """The Fed Server, as an agent hosting many devices registers them and asks for their tasks
    (its session)."""

    def register_batch(self, req: RegistrationBatch) -> RegistrationBatchResponse:
        """Enrol several devices, each answered on its own (registered with its token, or refused)."""

    def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
        """Add ``req``'s idle devices to the agent's session; tasks for any of its idle devices,
        held up to ``req.wait_s`` until one has work."""


class SecureBatchApi(Protocol):
    """The Fed Server's secure aggregation stages, as an agent sends them for many of its devices."""

    def secagg_batch(self, round_id: int, req: SecAggBatch) -> SecAggBatchAck:
        """Several devices' secure aggregation messages of attempt ``round_id``, each taken or refused."""

    def secagg_ask_batch(self, round_id: int, stage: str, req: SecAggQuestion) -> SecAggAnswers:
        """``stage``'s answer for several devices, held up to ``req.wait_s`` until it closes."""


class MainApi(Protocol):
    """The Main Server of one round's split training, as one device sees it."""

    url: str

    @property
    def bytes_up(self) -> int:
        """Body bytes sent so far (the device's communication figures)."""

    @property
    def bytes_down(self) -> int:
        """Body bytes received so far."""

    def join(self, round_id: int, req: JoinRequest, timeout: float) -> JoinResponse:
        """Join the round; answered when the groups are formed."""

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        """One local step's activations and labels; answered with their gradient."""

    def close(self) -> None:
        """Release the connection (the device moves to another URL or token)."""


@runtime_checkable
class UShapedMainApi(MainApi, Protocol):
    """A Main Server client that also sends a U-shaped round's steps, in their two halves."""

    def forward(self, round_id: int, req: ForwardRequest, timeout: float) -> ForwardResponse:
        """U-shaped round: one local step's activations; answered with the middle's output."""

    def backward(self, round_id: int, req: BackwardRequest, timeout: float) -> BackwardResponse:
        """U-shaped round: the step's gradient at the middle's output; answered with dfx."""
