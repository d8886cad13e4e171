"""The HTTP clients of a device (and of an agent's task session): the Fed Server and Main Server interfaces of :mod:`device_agent.api`
over msgpack HTTP, with the enrolment secret, the bearer token, retries and byte counting.

Errors are translated at this boundary: an error status becomes the domain error the server
raised (the inverse of ``http_api/server.py``'s map), a transport failure :class:`Unreachable`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from pydantic import BaseModel

from device_agent.api import Unreachable
from shared.errors import Conflict, DomainError, Failed, Invalid, NotAllowed, NotFound, TooSoon, Unauthenticated
from device_agent.task_expired import TaskExpired
from shared.http_client import Cancellation, Cancelled, M, ServiceError, SyncClient
from shared.schemas import (
    API, Ack, AgentTaskRequest, AgentTaskResponse, BackwardRequest, BackwardResponse, ForwardRequest, ForwardResponse,
    RegistrationBatch, RegistrationBatchResponse, EvaluationReport, JoinRequest, JoinResponse, RegisterRequest, RegisterResponse, ReportRequest, RunInfo, StepRequest,
    SecAggAnswers, SecAggBatch, SecAggBatchAck, SecAggQuestion, StepResponse, TaskResponse, UpdateRequest, WeightsId,
    WeightsResponse, WithdrawRequest,
)

#: The domain error of each status the servers answer with (see http_api/server.py).
ERROR_OF_STATUS: dict[int, type[DomainError]] = {
    401: Unauthenticated, 403: NotAllowed, 404: NotFound, 409: Conflict, 422: Invalid, 500: Failed,
}


#: Seconds a device waits before asking again after a 429 that named no ``Retry-After``.
DEFAULT_RETRY_AFTER_S = 1.0


def domain_error(exc: ServiceError) -> DomainError:
    """The domain error for an error answer."""
    return error_for_status(exc.status, str(exc), exc.retry_after_s)


def error_for_status(status: int, detail: str, retry_after_s: float | None = None) -> DomainError:
    """The domain error a server meant by ``status``: 429 is :class:`TooSoon` with the answer's
    ``Retry-After``; other 4xx (e.g. 413) read as Invalid, 5xx as Failed. Also for the refusals a
    registration batch lists."""
    if status == 429:
        return TooSoon(detail, DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s)
    kind = ERROR_OF_STATUS.get(status, Invalid if status < 500 else Failed)
    return kind(detail)


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except ServiceError as exc:
        raise domain_error(exc) from None
    except httpx.TransportError as exc:
        raise Unreachable(f"{type(exc).__name__}: {exc}") from None


class HttpFedClient:
    """:class:`device_agent.api.FedApi` over HTTP. One per device: it carries that device's token."""

    def __init__(self, url: str, verify: bool | str = True, enrolment_secret: bytes | None = None,
                 retries: int = 3, request_delay_s: float = 0.0) -> None:
        self._http = SyncClient(url, retries=retries, verify=verify, request_delay_s=request_delay_s)
        self._enrolment_secret = enrolment_secret

    def run_info(self) -> RunInfo:
        """Asked once: its caller (:func:`device_agent.run_spec.wait_for_run`) waits for a Fed Server
        that is still starting, with one log line rather than the client's warning per retry."""
        with _translated():
            return self._http.call("GET", f"{API}/run", RunInfo, retries=0)

    def register(self, req: RegisterRequest) -> RegisterResponse:
        with _translated():
            answer = self._http.call("POST", f"{API}/devices/register", RegisterResponse, req,
                                     headers=self._enrolment_headers())
        self._http.set_token(answer.token)
        return answer

    def register_batch(self, req: RegistrationBatch) -> RegistrationBatchResponse:
        """Several devices at once (:class:`device_agent.api.AgentApi`); their tokens are theirs,
        not this client's."""
        with _translated():
            return self._http.call("POST", f"{API}/devices/registrations", RegistrationBatchResponse, req,
                                   headers=self._enrolment_headers())

    def _enrolment_headers(self) -> dict[str, str] | None:
        return {"x-enrolment-secret": self._enrolment_secret.decode()} if self._enrolment_secret else None

    def use_token(self, token: str | None) -> None:
        self._http.set_token(token)

    def task(self, device_id: str, wait_s: float = 0.0) -> tuple[TaskResponse, int]:
        # The read may last the whole wait: the timeout covers it plus the usual allowance.
        return self._sized_get(f"{API}/devices/{device_id}/task", TaskResponse,
                               params={"wait_s": f"{wait_s:g}"} if wait_s > 0 else None,
                               timeout=wait_s + 60.0 if wait_s > 0 else None)

    def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
        """The agent's session request (:class:`device_agent.api.AgentApi`); its devices' tokens
        travel in the body, so this client needs none of its own."""
        with _translated():
            return self._http.call("POST", f"{API}/agents/{agent_id}/tasks", AgentTaskResponse, req,
                                   timeout=req.wait_s + 60.0)

    def weights(self, device_id: str, weights_id: WeightsId,
                cancel: Cancellation | None = None) -> tuple[WeightsResponse, int]:
        try:
            return self._sized_get(f"{API}/devices/{device_id}/weights/{weights_id}", WeightsResponse, cancel=cancel)
        except Cancelled as exc:
            raise TaskExpired(f"the Fed Server closed the task's attempt; its weights' download was given up: {exc}") \
                from None

    def _sized_get(self, path: str, model: type[M], params: dict | None = None,
                   timeout: float | None = None, cancel: Cancellation | None = None) -> tuple[M, int]:
        """GET ``path`` as ``model``, with the answer's body size (the device's transfer timing)."""
        before = self._http.bytes.down
        with _translated():
            answer = self._http.call("GET", path, model, params=params, timeout=timeout, cancel=cancel)
        return answer, self._http.bytes.down - before

    def report(self, req: ReportRequest) -> None:
        with _translated():
            self._http.call("POST", f"{API}/rounds/{req.round_id}/reports", Ack, req)

    def upload(self, req: UpdateRequest) -> None:
        with _translated():
            self._http.call("POST", f"{API}/rounds/{req.round_id}/updates", Ack, req)

    def evaluation(self, req: EvaluationReport) -> None:
        with _translated():
            self._http.call("POST", f"{API}/evaluation", Ack, req)

    def withdraw(self, req: WithdrawRequest) -> None:
        with _translated():
            self._http.call("POST", f"{API}/rounds/{req.round_id}/withdrawals", Ack, req)

    def secagg_send(self, round_id: int, stage: str, req: BaseModel) -> None:
        with _translated():
            self._http.call("POST", f"{API}/rounds/{round_id}/secagg/{stage}", Ack, req)

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float, model: type[M]) -> M:
        with _translated():
            return self._http.call("GET", f"{API}/rounds/{round_id}/secagg/{stage}", model,
                                   params={"device_id": device_id, "wait_s": f"{wait_s:g}"}, timeout=wait_s + 60.0)

    def secagg_batch(self, round_id: int, req: SecAggBatch) -> SecAggBatchAck:
        """An agent's devices' messages (:class:`device_agent.api.AgentApi`); their tokens travel in the body."""
        with _translated():
            return self._http.call("POST", f"{API}/rounds/{round_id}/secagg/batch", SecAggBatchAck, req)

    def secagg_ask_batch(self, round_id: int, stage: str, req: SecAggQuestion) -> SecAggAnswers:
        with _translated():
            return self._http.call("POST", f"{API}/rounds/{round_id}/secagg/{stage}/batch", SecAggAnswers, req,
                                   timeout=req.wait_s + 60.0)

    def close(self) -> None:
        self._http.close()


class HttpMainClient:
    """:class:`device_agent.api.MainApi` over HTTP, for one Main Server URL and one device token."""

    def __init__(self, url: str, token: str | None, verify: bool | str = True, retries: int = 3,
                 request_delay_s: float = 0.0) -> None:
        self._http = SyncClient(url, retries=retries, verify=verify, request_delay_s=request_delay_s)
        self._http.set_token(token)
        self.url = self._http.base_url

    @property
    def bytes_up(self) -> int:
        return self._http.bytes.up

    @property
    def bytes_down(self) -> int:
        return self._http.bytes.down

    def join(self, round_id: int, req: JoinRequest, timeout: float) -> JoinResponse:
        with _translated():
            return self._http.call("POST", f"{API}/rounds/{round_id}/join", JoinResponse, req, timeout=timeout)

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        with _translated():
            return self._http.call("POST", f"{API}/rounds/{round_id}/step", StepResponse, req, timeout=timeout)

    def forward(self, round_id: int, req: ForwardRequest, timeout: float) -> ForwardResponse:
        with _translated():
            return self._http.call("POST", f"{API}/rounds/{round_id}/step/forward", ForwardResponse, req,
                                   timeout=timeout)

    def backward(self, round_id: int, req: BackwardRequest, timeout: float) -> BackwardResponse:
        with _translated():
            return self._http.call("POST", f"{API}/rounds/{round_id}/step/backward", BackwardResponse, req,
                                   timeout=timeout)

    def close(self) -> None:
        self._http.close()


def main_connector(verify: bool | str = True, request_delay_s: float = 0.0) -> Callable[[str, str | None], HttpMainClient]:
    """How a device opens a Main Server client for a task's URL with its current token."""
    return lambda url, token: HttpMainClient(url, token, verify=verify, request_delay_s=request_delay_s)
