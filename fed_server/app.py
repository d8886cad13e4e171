"""The Fed Server's HTTP routes. Devices only call out (register, poll for a task, report,
upload, report an evaluation); the Main Server uploads group portions. The round driver (``driver.py``) starts with the
app and runs beside the routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import TypeVar

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import Response

from fed_server.coordinator import Coordinator
from fed_server.driver import drive_rounds
from fed_server.settings import FedServerSettings
from fed_server.metrics import FedMetrics
from fed_server.records import RunStatus
from fed_server.reregistrations import hold_for
from fed_server.secure_stages import SecureStage
from http_api.server import (
    ApiError, MsgpackResponse, arrival_seconds, create_service_app, msgpack_body_schema, msgpack_response, parse_message,
    read_body, read_message, request_target, status_of,
)
from shared.schemas import (
    AGENT_ID_PATTERN, API, MAX_AGENT_DEVICES, MAX_REGISTRATION_BATCH, AgentTaskRequest, EvaluationReport, Refusal,
    RegisterRequest, RegisterResponse, RegistrationBatch, RegistrationBatchResponse, ReportRequest, SecAggAnswers,
    SecAggBatch, SecAggBatchAck, SecAggInbox, SecAggKeys, SecAggQuestion, SecAggRoster, SecAggShares, SecAggUnmask,
    ServerPortionUpload, UpdateRequest, WithdrawRequest,
)
from shared.auth import FED_SERVER
from shared.errors import DomainError, TooSoon
from shared.short_list import short_list
from shared.wire import WireError, pack_body, unpackb

log = logging.getLogger("fed_server")

Registration = TypeVar("Registration", RegisterRequest, RegistrationBatch)

#: What a device sends with its device id in the body.
DeviceMessage = TypeVar("DeviceMessage", UpdateRequest, ReportRequest, WithdrawRequest, EvaluationReport, SecAggKeys,
                        SecAggShares, SecAggUnmask)

#: The longest a ``/v1/status`` answer is held (``wait_s``).
MAX_STATUS_WAIT_S = 30.0


def create_app(coordinator: Coordinator, settings: FedServerSettings | None = None) -> FastAPI:
    """The Fed Server as an ASGI app; the round driver starts with the app."""
    settings = settings or FedServerSettings()
    metrics = FedMetrics(coordinator, per_device=settings.per_device_series(coordinator.config.data.num_devices))
    app = create_service_app("fed_server", "S2FL Fed Server", lifespan=_lifespan(coordinator, settings, metrics),
                             registry=metrics.registry, description=(
        "Global model, client time table, device selection, split choice, layer-wise aggregation."))
    app.state.coordinator = coordinator
    app.state.metrics = metrics
    app.on_stopping += [coordinator.status_posted.close, coordinator.core.work_posted.close]
    _add_run_routes(app, coordinator, settings)
    _add_device_routes(app, coordinator, settings)
    _add_upload_routes(app, coordinator, settings)
    _add_secure_routes(app, coordinator, settings)
    return app


def _lifespan(coordinator: Coordinator, settings: FedServerSettings, metrics: FedMetrics):
    """Start the round driver with the app, stop it with the app."""
    def _driver_stopped(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("round driver failed", exc_info=task.exception())
        coordinator.status_posted.post()   # a failed driver is news to a status request waiting for a record

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(drive_rounds(coordinator, settings, metrics))
        task.add_done_callback(_driver_stopped)
        app.state.driver = task
        revocations = settings.auth.revoked_credentials
        if revocations.path is not None:   # the operator applies a revocation with SIGHUP, not a restart
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, coordinator.enrolment.reload_revocations,
                                                          revocations)
        yield
        task.cancel()
    return lifespan


def _add_run_routes(app: FastAPI, coordinator: Coordinator, settings: FedServerSettings) -> None:
    """Anyone: the run's progress; the Main Server: group portions."""
    @app.get(f"{API}/status")
    async def status(since: int = 0, seen: int = Query(0, ge=0),
                     wait_s: float = Query(0.0, ge=0.0, le=MAX_STATUS_WAIT_S)) -> RunStatus:
        """Run progress as JSON: state, round, and the records of the logical rounds after ``since``
        (every attempt of them, failed ones included). With ``wait_s``, the answer is held until
        the run has more than ``seen`` records, has finished or its driver failed (long-poll)."""
        def current() -> RunStatus:
            return coordinator.status(since, _driver_error(app))

        def news(answer: RunStatus) -> bool:
            return answer.records > seen or answer.state == "finished" or answer.driver_error is not None
        return await coordinator.status_posted.hold(current, news, wait_s)

    @app.post(f"{API}/rounds/{{round_id}}/server-portions", response_class=Response,
              openapi_extra=msgpack_body_schema(ServerPortionUpload))
    async def server_portion(round_id: int, request: Request) -> Response:
        """Main Server: a group's trained server-side copy."""
        signed = settings.auth.check_service(FED_SERVER, request.method, request_target(request), request.headers)
        upload = await read_message(request, ServerPortionUpload, settings.max_update_bytes, signed)
        size = int(request.headers.get("content-length", 0))
        return msgpack_response(coordinator.uploads.accept_portion(round_id, upload, size))


def _add_device_routes(app: FastAPI, coordinator: Coordinator, settings: FedServerSettings) -> None:
    """Devices: the run's spec, registration, tasks and the weights they name."""
    @app.get(f"{API}/run", response_class=Response)
    async def run_info() -> Response:
        """Device: the run's model and data spec (to load its shard before registering)."""
        return msgpack_response(coordinator.enrolment.run_info())

    @app.post(f"{API}/devices/register", response_class=Response, openapi_extra=msgpack_body_schema(RegisterRequest))
    async def register(request: Request) -> Response:
        """Device: announce itself, its shard and its profile; get the run's data and model spec."""
        enrolment = settings.auth.check_enrolment(request.headers)
        req = await _registration(request, RegisterRequest, settings.max_register_bytes)
        try:
            return msgpack_response(coordinator.enrolment.enrol(req, enrolment, settings.auth))
        except TooSoon as exc:
            await asyncio.sleep(hold_for([exc]))
            raise

    @app.post(f"{API}/devices/registrations", response_class=Response,
              openapi_extra=msgpack_body_schema(RegistrationBatch))
    async def registrations(request: Request) -> Response:
        """Agent: register several devices at once, each as it would alone; the answer says, for
        each, its registration or why it was refused (docs/api.md)."""
        enrolment = settings.auth.check_enrolment(request.headers)
        batch = await _registration(request, RegistrationBatch, MAX_REGISTRATION_BATCH * settings.max_register_bytes)
        answer = RegistrationBatchResponse()
        outcomes = coordinator.enrolment.enrol_each(batch.devices, enrolment, settings.auth)
        too_soon = [outcome for outcome in outcomes if isinstance(outcome, TooSoon)]
        if too_soon and len(too_soon) == len(outcomes):
            # Only a batch of nothing but re-registrations too soon is held: a batch that registers
            # a device is answered at once.
            await asyncio.sleep(hold_for(too_soon))
        for req, outcome in zip(batch.devices, outcomes):
            if isinstance(outcome, RegisterResponse):
                answer.registered.append(outcome)
            else:
                answer.refused[req.device_id] = _refusal(outcome)
        return msgpack_response(answer)

    @app.get(f"{API}/devices/{{device_id}}/task", response_class=Response)
    async def task(device_id: str, request: Request, wait_s: float = 0.0) -> Response:
        """Device: ask for work (wait / train this split point / evaluate / done), the weights named
        by ``weights_id``. With ``wait_s`` (at most 30) a ``wait`` answer is held until work is
        posted for the device or ``wait_s`` passes (long-poll)."""
        _check_device(coordinator, settings, request, device_id)
        answer = await coordinator.dispatch.next_task(device_id, wait_s)
        response = msgpack_response(answer)
        coordinator.dispatch.count_task_bytes(answer, len(response.body))
        return response

    @app.post(f"{API}/agents/{{agent_id}}/tasks", response_class=Response,
              openapi_extra=msgpack_body_schema(AgentTaskRequest))
    async def agent_tasks(request: Request, agent_id: str = Path(pattern=AGENT_ID_PATTERN)) -> Response:
        """Agent: add its idle devices (with their tokens) to its session, and get tasks for any
        of the session's idle devices, held up to ``wait_s`` until one has work (docs/api.md)."""
        req = await read_message(request, AgentTaskRequest, settings.max_register_bytes)
        answer = await coordinator.agents.next_tasks(agent_id, req, settings.auth.enabled)
        for device_task in answer.tasks:
            coordinator.dispatch.count_task_bytes(device_task.task, pack_body(device_task.model_dump()).size)
        return msgpack_response(answer)

    @app.get(f"{API}/devices/{{device_id}}/weights/{{weights_id}}", response_class=Response)
    async def weights(device_id: str, weights_id: str, request: Request) -> Response:
        """Device: the weights a task named (a ``WeightsResponse``), served while that task's attempt,
        evaluation phase or final answer lasts (404 after). One packed body serves every fetch."""
        _check_device(coordinator, settings, request, device_id)
        return MsgpackResponse(coordinator.core.weights.body(weights_id))


def _add_upload_routes(app: FastAPI, coordinator: Coordinator, settings: FedServerSettings) -> None:
    """Devices: updates, reports, withdrawals and evaluation reports, each from a device holding
    its current token."""
    @app.post(f"{API}/rounds/{{round_id}}/updates", response_class=Response, openapi_extra=msgpack_body_schema(UpdateRequest))
    async def update(round_id: int, request: Request) -> Response:
        """Device: trained client portion (or whole model), sample count and timings."""
        read_since = time.monotonic()
        req = await _device_message(coordinator, settings, request, UpdateRequest, settings.max_update_bytes)
        upload_s = arrival_seconds(request, read_since)
        size = int(request.headers.get("content-length", 0))
        return msgpack_response(coordinator.uploads.accept_update(round_id, req, size, upload_s))

    @app.post(f"{API}/rounds/{{round_id}}/reports", response_class=Response, openapi_extra=msgpack_body_schema(ReportRequest))
    async def report(round_id: int, request: Request) -> Response:
        """Device (two-phase algorithms): post-training report; the follow-up comes with the next poll."""
        req = await _device_message(coordinator, settings, request, ReportRequest, settings.max_register_bytes)
        return msgpack_response(coordinator.uploads.accept_report(round_id, req))

    @app.post(f"{API}/rounds/{{round_id}}/withdrawals", response_class=Response,
              openapi_extra=msgpack_body_schema(WithdrawRequest))
    async def withdrawal(round_id: int, request: Request) -> Response:
        """Device: it cannot contribute to this attempt; it is taken out at once (no wait for it)."""
        req = await _device_message(coordinator, settings, request, WithdrawRequest, settings.max_register_bytes)
        return msgpack_response(coordinator.uploads.withdraw(round_id, req))

    @app.post(f"{API}/evaluation", response_class=Response, openapi_extra=msgpack_body_schema(EvaluationReport))
    async def evaluation(request: Request) -> Response:
        """Device (federated evaluation): how the round's global model did on its held-out part."""
        req = await _device_message(coordinator, settings, request, EvaluationReport, settings.max_register_bytes)
        return msgpack_response(coordinator.evaluation.accept(req))


def _add_secure_routes(app: FastAPI, coordinator: Coordinator, settings: FedServerSettings) -> None:
    """Devices: secure aggregation's stages (docs/privacy.md), each message from a device holding
    its current token; the GETs are long polls held up to ``wait_s`` (at most 30) until the stage
    closes."""
    secure = coordinator.secure
    prefix = f"{API}/rounds/{{round_id}}/secagg"

    @app.post(f"{prefix}/keys", response_class=Response, openapi_extra=msgpack_body_schema(SecAggKeys))
    async def secagg_keys(round_id: int, request: Request) -> Response:
        """Stage 1: the device's public keys for the attempt."""
        req = await _device_message(coordinator, settings, request, SecAggKeys, settings.max_register_bytes)
        return msgpack_response(secure.accept_keys(round_id, req))

    @app.post(f"{prefix}/shares", response_class=Response, openapi_extra=msgpack_body_schema(SecAggShares))
    async def secagg_shares(round_id: int, request: Request) -> Response:
        """Stage 2: the device's secret shares, each sealed for one other roster device."""
        limit = secure.message_limit(round_id, 1, settings.max_update_bytes)
        req = await _device_message(coordinator, settings, request, SecAggShares, limit.bytes, limit.entries)
        return msgpack_response(secure.accept_shares(round_id, req))

    @app.get(f"{prefix}/{{stage}}", response_class=Response)
    async def secagg_stage(round_id: int, stage: SecureStage, device_id: str, request: Request,
                           wait_s: float = 0.0) -> Response:
        """A stage's answer once it closed: ``roster`` (stage 1: the devices that sent keys, with
        them, and the threshold), ``inbox`` (stage 2: the shares sealed for the device by the devices
        that shared), ``unmask`` (stage 4's question once uploads closed: survivors and dropped)."""
        _check_device(coordinator, settings, request, device_id)
        return msgpack_response(await secure.ask(round_id, stage, device_id, wait_s))

    @app.post(f"{prefix}/unmask", response_class=Response, openapi_extra=msgpack_body_schema(SecAggUnmask))
    async def secagg_unmask(round_id: int, request: Request) -> Response:
        """Stage 4: the device's shares of the survivors' seeds and the dropped devices' mask keys."""
        limit = secure.message_limit(round_id, 1, settings.max_update_bytes)
        req = await _device_message(coordinator, settings, request, SecAggUnmask, limit.bytes, limit.entries)
        return msgpack_response(secure.accept_unmask(round_id, req))

    batches = coordinator.secure_batches

    @app.post(f"{prefix}/batch", response_class=Response, openapi_extra=msgpack_body_schema(SecAggBatch))
    async def secagg_batch(round_id: int, request: Request) -> Response:
        """Agent: several of its devices' keys, shares or unmasking answers, each device with its
        current token in the body; each message is taken or refused (in ``refused``) on its own."""
        limit = secure.message_limit(round_id, MAX_AGENT_DEVICES, settings.max_update_bytes)
        req = await read_message(request, SecAggBatch, limit.bytes, max_entries=limit.entries)
        refused = batches.accept(round_id, req, settings.auth.enabled)
        return msgpack_response(SecAggBatchAck(refused={d: _refusal(e) for d, e in refused.items()}))

    @app.post(f"{prefix}/{{stage}}/batch", response_class=Response, openapi_extra=msgpack_body_schema(SecAggQuestion))
    async def secagg_stage_batch(round_id: int, stage: SecureStage, request: Request) -> Response:
        """Agent: ``stage``'s answer for several of its devices, held up to ``wait_s`` (at most 30)
        until the stage closes; a device refused (taken out, not its current token) in ``refused``."""
        req = await read_message(request, SecAggQuestion, settings.max_register_bytes)
        outcomes = await batches.ask(round_id, stage, req.devices, req.wait_s, settings.auth.enabled)
        answer = SecAggAnswers()
        for device_id, outcome in outcomes.items():
            if isinstance(outcome, DomainError):
                answer.refused[device_id] = _refusal(outcome)
            elif isinstance(outcome, SecAggRoster):
                answer.rosters[device_id] = outcome
            elif isinstance(outcome, SecAggInbox):
                answer.inboxes[device_id] = outcome
            else:
                answer.plans[device_id] = outcome
        return msgpack_response(answer)


def _refusal(exc: DomainError) -> Refusal:
    """One device's refusal in a batch's answer: what its own request would have been answered with."""
    return Refusal(status=status_of(exc), detail=str(exc),
                   retry_after_s=exc.retry_after_s if isinstance(exc, TooSoon) else None)


async def _registration(request: Request, model: type[Registration], limit: int) -> Registration:
    """A registration's body (one device's or a batch's). One that is refused before the enrolment
    sees it (400 not msgpack, 422 a field missing or malformed: a fingerprint of another version's
    format) is logged with the devices it names, as the enrolment logs its own refusals: an operator
    must not learn of it only from a run that starts short of devices."""
    body = await read_body(request.stream(), request.headers.get("content-length"), limit)
    try:
        return parse_message(body, model)
    except ApiError as exc:
        log.warning("registration of %s refused (%d): %s", _named_devices(body), exc.status, exc.detail)
        raise


def _named_devices(body: bytes | bytearray) -> str:
    """The device ids a registration body names (``device_id``, or a batch's ``devices``), for a
    log line: at most five, each cut to 64 characters; ``an unnamed device`` when there is none."""
    try:
        obj = unpackb(body)
    except WireError:
        obj = None
    batch = obj.get("devices") if isinstance(obj, dict) else None
    entries: list = batch if isinstance(batch, list) else [obj]
    names = [str(e["device_id"])[:64] for e in entries if isinstance(e, dict) and "device_id" in e]
    if not names:
        return "an unnamed device"
    return short_list(names, 5)


async def _device_message(coordinator: Coordinator, settings: FedServerSettings, request: Request,
                          model: type[DeviceMessage], limit: int, max_entries: int | None = None) -> DeviceMessage:
    """A device's message of at most ``limit`` bytes (and ``max_entries`` map entries and array
    elements), read only once its token names a device this server enrolled
    (:meth:`DeviceEnrolment.caller`: an unauthenticated body is refused before it is read), and
    checked to be that device's."""
    caller = coordinator.enrolment.caller(request.headers, settings.auth)
    message = await read_message(request, model, limit, max_entries=max_entries)
    coordinator.enrolment.check_caller(caller, message.device_id)
    return message


def _check_device(coordinator: Coordinator, settings: FedServerSettings, request: Request, device_id: str) -> None:
    """The caller holds ``device_id``'s current token (:meth:`DeviceEnrolment.check_token`)."""
    coordinator.enrolment.check_token(request.headers, device_id, settings.auth)


def _driver_error(app: FastAPI) -> str | None:
    task = getattr(app.state, "driver", None)
    if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        return repr(task.exception())
    return None
