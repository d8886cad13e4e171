"""The Fed Server's HTTP routes. Devices only call out (register, poll for a task, report,
upload, report an evaluation); the Main Server uploads group portions. The round driver (``driver.py``) starts with the
app and runs beside the routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from fed_server.coordinator import Coordinator
from fed_server.driver import FedServerSettings, drive_rounds
from fed_server.metrics import FedMetrics
from fed_server.records import RunStatus, finite_json
from shared.errors import NotFound
from http_api.server import MSGPACK, create_service_app, msgpack_body_schema, msgpack_response, read_message
from shared.schemas import API, EvaluationReport, RegisterRequest, ReportRequest, ServerPortionUpload, UpdateRequest
from shared.wire import packb

log = logging.getLogger("fed_server")


def create_app(coordinator: Coordinator, settings: FedServerSettings | None = None) -> FastAPI:
    """The Fed Server as an ASGI app; the round driver starts with the app."""
    settings = settings or FedServerSettings()
    metrics = FedMetrics(coordinator, per_device=settings.per_device_metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(drive_rounds(coordinator, settings, metrics))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.error("round driver failed", exc_info=t.exception()))
        app.state.driver = task
        yield
        task.cancel()

    app = create_service_app("fed_server", "S2FL Fed Server", lifespan=lifespan, registry=metrics.registry, description=(
        "Global model, client time table, device selection, split choice, layer-wise aggregation."))
    app.state.coordinator = coordinator
    app.state.metrics = metrics
    packed_done: dict[bool, bytes] = {}  # the final answer's body by final_weights (see task())

    def check_device(request: Request, device_id: str) -> None:
        """The caller holds ``device_id``'s current token in this run. A caller with a token for a
        device this server does not know gets 404, not 403: that is how an agent learns that a
        restarted Fed Server forgot it and registers again."""
        nonce = coordinator.devices.token_nonce(device_id)
        if nonce is None and settings.auth.enabled and "authorization" in request.headers:
            raise NotFound(f"unknown device {device_id!r}: register first")
        settings.auth.check_device(request.headers, coordinator.run_id, device_id, nonce)

    @app.get(f"{API}/status")
    async def status(since: int = 0) -> RunStatus:
        """Run progress as JSON: state, round, and the records of the logical rounds after ``since``
        (every attempt of them, failed ones included)."""
        c = coordinator
        state = "finished" if c.finished else ("running" if c.ready() else "waiting_for_devices")
        return RunStatus(
            run_id=c.run_id, algorithm=c.config.algorithm, state=state, rounds_total=c.config.rounds,
            rounds_done=c.rounds_recorded, registered=len(c.devices), expected_devices=c.config.data.num_devices,
            open_round=c.round.round_id if c.round else None, initial=c.initial,
            history=[r for r in c.history if r.round > since],
            summary=finite_json(c.summary()) if c.finished else None, driver_error=_driver_error(app),
        )

    @app.get(f"{API}/run", response_class=Response)
    async def run_info() -> Response:
        """Device: the run's model and data spec (to load its shard before registering)."""
        return msgpack_response(coordinator.run_info())

    @app.post(f"{API}/devices/register", response_class=Response, openapi_extra=msgpack_body_schema(RegisterRequest))
    async def register(request: Request) -> Response:
        """Device: announce itself, its shard and its profile; get the run's data and model spec."""
        settings.auth.check_enrolment(request.headers)
        req = await read_message(request, RegisterRequest, settings.max_register_bytes)
        known = req.device_id in coordinator.devices.devices
        answer = coordinator.register(req)
        if settings.auth.enabled:
            # Enrolment under a known id (an agent restarted and lost its token) issues a new
            # token and revokes the old one: the registry drew a new nonce (docs/security.md).
            if known:
                log.warning("device %s enrolled again: its previous token is revoked", req.device_id)
            answer.token = settings.auth.device_token(coordinator.run_id, req.device_id,
                                                      coordinator.devices.devices[req.device_id].token_nonce)
        return msgpack_response(answer)

    @app.get(f"{API}/devices/{{device_id}}/task", response_class=Response)
    async def task(device_id: str, request: Request, final_weights: bool = True, wait_s: float = 0.0) -> Response:
        """Device: ask for work (wait / train with weights and split point / evaluate / done, with
        the final model unless ``final_weights=false``). With ``wait_s`` (at most 30) a ``wait``
        answer is held until work is posted for the device or ``wait_s`` passes (long-poll)."""
        check_device(request, device_id)
        answer = await coordinator.next_task(device_id, final_weights, wait_s)
        if answer.status == "done":
            # Every device polls for the same final answer at about the same time: one packed
            # body shared by all responses, not one copy of the model per device in flight.
            if final_weights not in packed_done:
                packed_done[final_weights] = packb(answer.model_dump())
            return Response(content=packed_done[final_weights], media_type=MSGPACK)
        response = msgpack_response(answer)
        if answer.status == "train" and coordinator.round is not None:
            coordinator.round.task_bytes += len(response.body)
        elif answer.status == "evaluate" and coordinator.evaluating is not None:
            coordinator.evaluating.task_bytes += len(response.body)
        return response

    @app.post(f"{API}/rounds/{{round_id}}/updates", response_class=Response, openapi_extra=msgpack_body_schema(UpdateRequest))
    async def update(round_id: int, request: Request) -> Response:
        """Device: trained client portion (or whole model), sample count and timings."""
        req = await read_message(request, UpdateRequest, settings.max_update_bytes)
        check_device(request, req.device_id)
        size = int(request.headers.get("content-length", 0))
        return msgpack_response(coordinator.accept_update(round_id, req, size))

    @app.post(f"{API}/rounds/{{round_id}}/reports", response_class=Response, openapi_extra=msgpack_body_schema(ReportRequest))
    async def report(round_id: int, request: Request) -> Response:
        """Device (two-phase algorithms): post-training report; the follow-up comes with the next poll."""
        req = await read_message(request, ReportRequest, settings.max_register_bytes)
        check_device(request, req.device_id)
        return msgpack_response(coordinator.accept_report(round_id, req))

    @app.post(f"{API}/evaluation", response_class=Response, openapi_extra=msgpack_body_schema(EvaluationReport))
    async def evaluation(request: Request) -> Response:
        """Device (federated evaluation): how the round's global model did on its held-out part."""
        req = await read_message(request, EvaluationReport, settings.max_register_bytes)
        check_device(request, req.device_id)
        return msgpack_response(coordinator.accept_evaluation(req))

    @app.post(f"{API}/rounds/{{round_id}}/server-portions", response_class=Response,
              openapi_extra=msgpack_body_schema(ServerPortionUpload))
    async def server_portion(round_id: int, request: Request) -> Response:
        """Main Server: a group's trained server-side copy."""
        settings.auth.check_service(request.headers)
        upload = await read_message(request, ServerPortionUpload, settings.max_update_bytes)
        size = int(request.headers.get("content-length", 0))
        return msgpack_response(coordinator.accept_portion(round_id, upload, size))

    return app


def _driver_error(app: FastAPI) -> str | None:
    task = getattr(app.state, "driver", None)
    if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        return repr(task.exception())
    return None
