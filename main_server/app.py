"""The Main Server's HTTP routes: round plans from the Fed Server, joins and steps (in U-shaped
rounds, their forward and backward halves) from devices.

Routes only: authentication, body parsing and the answer's encoding, and the HTTP sender of the
group portions (``main_server/portion_upload.py``). The logic is in ``main_server/server.py`` (open
round, portions) and ``main_server/group_round.py`` (barriers).
"""
from __future__ import annotations

from fastapi import Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import Headers

from http_api.server import (
    ServiceApp, create_service_app, msgpack_body_schema, msgpack_response, read_message, request_target,
)
from main_server.portion_upload import FedServerPortions
from main_server.server import MainServer, MainServerSettings
from shared.auth import MAIN_SERVER
from shared.errors import NotAllowed
from shared.schemas import (
    API, Ack, BackwardRequest, BackwardResponse, Departures, ForwardRequest, ForwardResponse, JoinRequest, JoinResponse,
    RoundPlan, StepRequest, StepResponse,
)


def create_app(settings: MainServerSettings) -> ServiceApp:
    """The Main Server as an ASGI app; it sends finished groups' portions to the Fed Server over HTTP."""
    portions = FedServerPortions(settings.fed_server_url, settings.auth, settings.ca_file, settings.upload_retries)
    server = MainServer(settings, portions.send)
    app = create_service_app("main_server", "S2FL Main Server",
                             "Server-side portions, device groups, per-step training.",
                             registry=server.metrics.registry)
    app.state.server = server
    app.state.metrics = server.metrics
    app.on_stopping.append(server.stop_watching)

    @app.get(f"{API}/status")
    async def status() -> dict:
        return server.status()

    @app.post(f"{API}/rounds", response_class=Response, openapi_extra=msgpack_body_schema(RoundPlan))
    async def open_round(request: Request) -> Response:
        """Fed Server -> Main Server: the plan of a new round (replaces the open one)."""
        signed = settings.auth.check_service(MAIN_SERVER, request.method, request_target(request), request.headers)
        plan = await read_message(request, RoundPlan, settings.max_plan_bytes, signed)
        server.open_round(plan)
        return msgpack_response(Ack(detail=f"round {plan.round_id} open"))

    @app.post(f"{API}/rounds/{{round_id}}/departures", response_class=Response,
              openapi_extra=msgpack_body_schema(Departures))
    async def departures(round_id: int, request: Request) -> Response:
        """Fed Server -> Main Server: participants taken out of the attempt (a refused upload, a
        withdrawal); the join and their groups' barriers stop waiting for them."""
        signed = settings.auth.check_service(MAIN_SERVER, request.method, request_target(request), request.headers)
        body = await read_message(request, Departures, settings.max_join_bytes, signed)
        return msgpack_response(server.depart(round_id, body))

    @app.get(f"{API}/rounds/{{round_id}}/watch")
    async def watch(round_id: int, request: Request,
                    heartbeat_s: float = Query(2.0, ge=0.1, le=60.0)) -> StreamingResponse:
        """Fed Server: one JSON line per heartbeat while the round is open here, then ``done``
        (every group uploaded) or ``replaced``; 409 for a round that is not open."""
        settings.auth.check_service(MAIN_SERVER, request.method, request_target(request), request.headers)
        state = server.current(round_id)

        async def lines():
            async for line in server.watch(state, heartbeat_s):
                yield line.model_dump_json() + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    # Joins and steps are lean routes (http_api.server.ServiceApp.msgpack_post): a step is the
    # Main Server's hot path, 401 KB each way for every device's every batch.
    # Both check the caller's token before the body is read (MainServer.caller), and that the body
    # is the caller's after.
    @app.msgpack_post(f"{API}/rounds/{{round_id}}/join", JoinRequest, settings.max_join_bytes, before_body=server.caller)
    async def join(round_id: int, headers: Headers, message: JoinRequest, caller: str | None) -> JoinResponse:
        """Device: join the round with label counts; answered when groups are formed."""
        _check_caller(caller, message.device_id)
        return await server.join(round_id, message)

    @app.msgpack_post(f"{API}/rounds/{{round_id}}/step", StepRequest, settings.max_step_bytes, before_body=server.caller)
    async def step(round_id: int, headers: Headers, message: StepRequest, caller: str | None) -> StepResponse:
        """Device: activations + labels of one local step; answered with dfx after the group's barrier."""
        _check_caller(caller, message.device_id)
        return await server.step(round_id, message)

    @app.msgpack_post(f"{API}/rounds/{{round_id}}/step/forward", ForwardRequest, settings.max_step_bytes,
                      before_body=server.caller)
    async def step_forward(round_id: int, headers: Headers, message: ForwardRequest, caller: str | None) -> ForwardResponse:
        """Device, U-shaped round: activations of one local step (no labels); answered with the
        middle's output after the group's barrier."""
        _check_caller(caller, message.device_id)
        return await server.forward(round_id, message)

    @app.msgpack_post(f"{API}/rounds/{{round_id}}/step/backward", BackwardRequest, settings.max_step_bytes,
                      before_body=server.caller)
    async def step_backward(round_id: int, headers: Headers, message: BackwardRequest,
                            caller: str | None) -> BackwardResponse:
        """Device, U-shaped round: the gradient at the middle's output of the step; answered with dfx
        once the group's copy has stepped."""
        _check_caller(caller, message.device_id)
        return await server.backward(round_id, message)

    return app


def _check_caller(caller: str | None, device_id: str) -> None:
    """The body names the participant whose token the request carried (None: authentication off)."""
    if caller is not None and caller != device_id:
        raise NotAllowed(f"the token is not the current token of device {device_id!r}")
