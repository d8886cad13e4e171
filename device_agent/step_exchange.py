"""A device's split training with the Main Server: the connection it keeps between rounds, the
round's join, and the per-step exchange (activations and labels up, their gradient down; in
U-shaped mode activations up, the middle's output down, its gradient up, dfx down), each charged
to the round's clock."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from device_agent.api import MainApi, UShapedMainApi
from shared.errors import Invalid
from device_agent.timing import RoundClock
from shared.schemas import (
    BackwardRequest, BackwardResponse, ForwardRequest, ForwardResponse, JoinRequest, StepRequest, StepResponse, WireTensor,
)
from shared.wire import WireError, decode_tensor, encode_tensor

#: Opens a Main Server client for a task's URL, presenting the device's current token.
MainConnector = Callable[[str, str | None], MainApi]
#: A Main Server answer that carries its wait and server time.
R = TypeVar("R", StepResponse, ForwardResponse, BackwardResponse)


class StepExchange:
    """One round's steps with its Main Server (a :data:`device_agent.trainer.StepFn`), and the body
    bytes the round moved to and from it, its join included."""

    def __init__(self, main: MainApi, device_id: str, round_id: int, clock: RoundClock, timeout: float) -> None:
        self.main = main
        self.device_id = device_id
        self.round_id = round_id
        self.clock = clock
        self.timeout = timeout
        self._up_before, self._down_before = main.bytes_up, main.bytes_down

    @property
    def bytes_up(self) -> int:
        """Body bytes sent to the Main Server this round."""
        return self.main.bytes_up - self._up_before

    @property
    def bytes_down(self) -> int:
        """Body bytes received from the Main Server this round."""
        return self.main.bytes_down - self._down_before

    def join(self, request: JoinRequest) -> None:
        """Join the round; answered once the groups are formed (that wait is charged as waiting
        for the other participants)."""
        main, clock = self.main, self.clock
        t0 = time.monotonic()
        before = main.bytes_up + main.bytes_down
        main.join(self.round_id, request, self.timeout)
        clock.transfer(main.bytes_up + main.bytes_down - before, 0.0)
        clock.wait_s += time.monotonic() - t0  # waiting for the other participants to join

    def __call__(self, step: int, fx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Send one step's activations and labels; return their gradient and the server's loss."""
        req = StepRequest(device_id=self.device_id, step=step, fx=WireTensor(**encode_tensor(fx)),
                          labels=WireTensor(**encode_tensor(labels)))
        resp = self._timed(lambda: self.main.step(self.round_id, req, self.timeout))
        return decode_tensor(resp.dfx, expect_shape=tuple(fx.shape), what="dfx"), resp.loss

    def forward(self, step: int, fx: torch.Tensor) -> tuple[torch.Tensor, float]:
        """U-shaped mode: send one step's activations (no label); return the middle's output for
        them and the device's loss weight."""
        req = ForwardRequest(device_id=self.device_id, step=step, fx=WireTensor(**encode_tensor(fx)))
        main = self._u_shaped()
        resp = self._timed(lambda: main.forward(self.round_id, req, self.timeout))
        output = decode_tensor(resp.output, what="output")
        if output.dim() == 0 or output.shape[0] != fx.shape[0]:
            raise WireError(f"output: shape {list(output.shape)} does not hold the step's {fx.shape[0]} samples")
        return output, resp.loss_weight

    def backward(self, step: int, gradient: torch.Tensor, expect_shape: tuple[int, ...]) -> torch.Tensor:
        """U-shaped mode: send the step's gradient at the middle's output; return dfx, which must
        have the activations' shape ``expect_shape``."""
        req = BackwardRequest(device_id=self.device_id, step=step, gradient=WireTensor(**encode_tensor(gradient)))
        main = self._u_shaped()
        resp = self._timed(lambda: main.backward(self.round_id, req, self.timeout))
        return decode_tensor(resp.dfx, expect_shape=expect_shape, what="dfx")

    def _u_shaped(self) -> UShapedMainApi:
        """The Main Server client, as one that sends a U-shaped round's halves (Invalid if it
        cannot: a client wrapped by code that knows only plain steps)."""
        if not isinstance(self.main, UShapedMainApi):
            raise Invalid(f"this round is U-shaped, and the Main Server client {type(self.main).__name__} "
                          f"sends plain steps only")
        return self.main

    def _timed(self, call: Callable[[], R]) -> R:
        """Make one call to the Main Server, charging its wait and server time, and its bytes and
        the rest of its time as transfer, to the round's clock."""
        main, clock = self.main, self.clock
        before = main.bytes_up + main.bytes_down
        t0 = time.monotonic()
        resp = call()
        elapsed = time.monotonic() - t0
        clock.server_time(resp.wait_s, resp.server_s)
        clock.transfer(main.bytes_up + main.bytes_down - before, elapsed - resp.wait_s - resp.server_s)
        return resp


class MainLink:
    """The device's Main Server client, kept from round to round while the tasks name the same
    URL, and opened anew for another URL or once the device has a new ``token``."""

    def __init__(self, connect: MainConnector) -> None:
        self.connect = connect
        self.token: str | None = None
        self.main: MainApi | None = None

    def new_token(self, token: str | None) -> None:
        """The device registered (again): the next task's client presents ``token``."""
        self.token = token
        self.drop()

    def drop(self) -> None:
        """Close the client, if one is open."""
        if self.main is not None:
            self.main.close()
            self.main = None

    def join(self, url: str, round_id: int, request: JoinRequest, clock: RoundClock, timeout: float) -> StepExchange:
        """Join round ``round_id`` at the Main Server at ``url``; return the round's step exchange."""
        if self.main is None or self.main.url != url.rstrip("/"):
            self.drop()
            self.main = self.connect(url, self.token)
        exchange = StepExchange(self.main, request.device_id, round_id, clock, timeout)
        exchange.join(request)
        return exchange
