"""The Main Server's HTTP layer: round plans from the Fed Server, joins and steps from devices."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from main_server.metrics import MainMetrics
from main_server.round_state import Group, RoundState
from shared.auth import Auth, token_nonce
from shared.http_client import decode_response, service_client
from shared.errors import Conflict
from http_api.server import create_service_app, msgpack_body_schema, msgpack_response, read_message
from shared.retry import Backoff, retry_async
from shared.schemas import API, Ack, JoinRequest, RoundPlan, ServerPortionUpload, StepRequest, StepResponse, WireTensor
from shared.wire import encode_state, encode_tensor, packb

log = logging.getLogger("main_server")


@dataclass
class MainServerSettings:
    fed_server_url: str
    max_plan_bytes: int = 512 << 20
    max_step_bytes: int = 64 << 20
    max_join_bytes: int = 64 << 10
    upload_retries: int = 5
    auth: Auth = field(default_factory=Auth)   # no service secret: open (docs/security.md)
    ca_file: str | None = None                 # CA bundle to verify the Fed Server's HTTPS certificate


class MainServer:
    """Holds the current round and pushes finished groups' server portions to the Fed Server."""

    def __init__(self, settings: MainServerSettings, metrics: MainMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else MainMetrics(self)
        self.round: RoundState | None = None
        self.uploads: set[asyncio.Task] = set()

    def current(self, round_id: int) -> RoundState:
        if self.round is None:
            raise Conflict("no round is open at the Main Server")
        if round_id != self.round.round_id:
            raise Conflict(f"round {round_id} is stale: the open round is {self.round.round_id}")
        return self.round

    def open_round(self, plan: RoundPlan) -> None:
        if self.round is not None and plan.run_id == self.round.plan.run_id and plan.round_id < self.round.round_id:
            raise Conflict(f"plan for round {plan.round_id} is older than the open round {self.round.round_id}")
        new = RoundState(plan, self._group_done, self.metrics)  # validates the plan before anything is replaced
        if self.round is not None:
            self.round.abandon()
        self.round = new
        self.metrics.round_opened()
        log.info("round %d opened: %d participants", plan.round_id, len(plan.participants))

    async def _group_done(self, state: RoundState, group: Group) -> None:
        upload = ServerPortionUpload(
            run_id=state.plan.run_id, round_id=state.round_id, group_id=group.group_id,
            members=sorted(group.done), dropped=sorted(group.dropped),
            absent=sorted(set(state.participants) - set(state.joined)), start_block=group.trainer.start,
            weights=encode_state(group.trainer.state()), label_distance=group.distance,
            steps=group.trainer.steps, train_time_s=group.train_time_s,
        )
        body = packb(upload.model_dump())
        url = f"{self.settings.fed_server_url.rstrip('/')}{API}/rounds/{state.round_id}/server-portions"
        what = f"round {state.round_id} group {group.group_id} upload"
        async with service_client(self.settings.auth.service_headers(), self.settings.ca_file, timeout=60.0) as client:
            async def post() -> Ack:
                return decode_response(await client.post(url, content=body), Ack)
            try:  # keep trying: the Fed Server may be restarting
                await retry_async(post, Backoff(self.settings.upload_retries, first_delay_s=0.5), (Exception,), what)
            except Exception as exc:
                log.error("%s abandoned: %s", what, exc)
                return
        log.info("%s done (%d bytes)", what, len(body))


def create_app(settings: MainServerSettings) -> FastAPI:
    """The Main Server as an ASGI app."""
    server = MainServer(settings)
    app = create_service_app("main_server", "S2FL Main Server",
                             "Server-side portions, label-balanced groups, per-step training.",
                             registry=server.metrics.registry)
    app.state.server = server
    app.state.metrics = server.metrics

    @app.get(f"{API}/status")
    async def status() -> dict:
        return {"round": server.round.summary() if server.round else None}

    @app.post(f"{API}/rounds", response_class=Response, openapi_extra=msgpack_body_schema(RoundPlan))
    async def open_round(request: Request) -> Response:
        """Fed Server -> Main Server: the plan of a new round (replaces the open one)."""
        settings.auth.check_service(request.headers)
        plan = await read_message(request, RoundPlan, settings.max_plan_bytes)
        server.open_round(plan)
        return msgpack_response(Ack(detail=f"round {plan.round_id} open"))

    @app.post(f"{API}/rounds/{{round_id}}/join", response_class=Response, openapi_extra=msgpack_body_schema(JoinRequest))
    async def join(round_id: int, request: Request) -> Response:
        """Device: join the round with label counts; answered when groups are formed."""
        req = await read_message(request, JoinRequest, settings.max_join_bytes)
        state = server.current(round_id)
        settings.auth.check_device(request.headers, state.plan.run_id, req.device_id, token_nonce(state.plan, req.device_id))
        return msgpack_response(await state.join(req))

    @app.post(f"{API}/rounds/{{round_id}}/step", response_class=Response, openapi_extra=msgpack_body_schema(StepRequest))
    async def step(round_id: int, request: Request) -> Response:
        """Device: activations + labels of one local step; answered with dfx after the group's barrier."""
        req = await read_message(request, StepRequest, settings.max_step_bytes)
        state = server.current(round_id)
        settings.auth.check_device(request.headers, state.plan.run_id, req.device_id, token_nonce(state.plan, req.device_id))
        outcome = await state.step(req)
        return msgpack_response(StepResponse(
            dfx=WireTensor(**encode_tensor(outcome.result.dfx)), loss=outcome.result.loss,
            wait_s=outcome.wait_s, server_s=outcome.server_s,
        ))

    return app

