"""The Main Server's round registry (main_server/server.py), without HTTP: a newer plan replaces
the open round, an older plan of the same run and a stale round id are conflicts, a bad plan
leaves the open round as it was; and a group portion's upload, which tries again only what another
try may get past."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from main_server.portion_upload import FedServerPortions
from main_server.server import MainServer, MainServerSettings
from shared.auth import Auth
from shared.errors import Conflict, Invalid
from shared.schemas import ServerPortionUpload

SETTINGS = MainServerSettings(fed_server_url="http://127.0.0.1:9")


async def _never_sent(upload: ServerPortionUpload) -> int:
    raise AssertionError("the registry tests finish no group, so no portion is sent")


def test_no_round_open(kit):
    async def body() -> None:
        server = MainServer(SETTINGS, _never_sent)
        with pytest.raises(Conflict, match="no round is open"):
            await server.join(1, kit.join_req("a"))
        assert server.status() == {"round": None}
    kit.run(body)


def test_newer_plan_replaces_the_open_round(kit):
    async def body() -> None:
        server = MainServer(SETTINGS, _never_sent)
        server.open_round(kit.make_plan(["a", "b"], round_id=1))
        first = server.round
        waiting = asyncio.create_task(server.join(1, kit.join_req("a")))
        assert await kit.pending(waiting)
        server.open_round(kit.make_plan(["a", "b"], round_id=2))
        with pytest.raises(Conflict, match="abandoned"):
            await waiting
        assert first.abandoned and server.round.round_id == 2
        with pytest.raises(Conflict, match="round 1 is stale"):
            await server.join(1, kit.join_req("b"))
        assert server.status()["round"]["round_id"] == 2
    kit.run(body)


def test_older_plan_of_the_same_run_is_refused(kit):
    async def body() -> None:
        server = MainServer(SETTINGS, _never_sent)
        server.open_round(kit.make_plan(["a"], round_id=5))
        current = server.round
        with pytest.raises(Conflict, match="older than the open round 5"):
            server.open_round(kit.make_plan(["a"], round_id=4))
        assert server.round is current and not current.abandoned
        # A new run starts its rounds afresh: its plan replaces the round whatever its id.
        server.open_round(kit.make_plan(["a"], round_id=1, run_id="next-run"))
        assert server.round.plan.run_id == "next-run" and current.abandoned
    kit.run(body)


def test_bad_plan_leaves_the_open_round(kit):
    async def body() -> None:
        server = MainServer(SETTINGS, _never_sent)
        server.open_round(kit.make_plan(["a"], round_id=1))
        current = server.round
        with pytest.raises(Invalid, match="unknown grouping"):
            server.open_round(kit.make_plan(["a"], round_id=2, grouping="psychic"))
        assert server.round is current and not current.abandoned
    kit.run(body)


def test_logic_modules_know_nothing_of_http():
    # The group round, its step checks and the round registry raise domain errors and hand portions
    # to a sender; only app.py speaks HTTP, and portion_upload.py sends the portions.
    code = ("import sys, main_server.group_round, main_server.step_checks, main_server.server; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette', 'httpx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])  # the repository root
    assert out.stdout.strip() == "[]"


def test_default_train_workers_is_one_per_usable_core_given_the_torch_threads(monkeypatch):
    import torch

    from shared.machine import compute_workers, usable_cores

    cores = usable_cores()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert compute_workers() == cores
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2 * cores)   # more threads a step than cores
    assert compute_workers() == 1
    server = MainServer(SETTINGS, _never_sent)
    assert server.trainers._max_workers == 1
    assert MainServer(MainServerSettings(fed_server_url="http://127.0.0.1:9", train_workers=3), _never_sent).trainers._max_workers == 3


@pytest.mark.parametrize("status, tries", [(422, 1), (409, 1), (503, 3)])
def test_a_refused_portion_is_not_sent_again_and_a_server_error_is(kit, status, tries):
    """A Fed Server on loopback that answers every portion upload with ``status``: a refusal (4xx)
    ends the upload at once, a server error is tried again (three tries here); either way the
    group is reported undelivered."""
    async def body() -> None:
        uploads: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            uploads.append(head.split(b" ")[1])
            detail = b'{"detail": "not this portion"}'
            writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                         % (status, len(detail), detail))
            await writer.drain()
            writer.close()

        fed = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = fed.sockets[0].getsockname()[1]
        portions = FedServerPortions(f"http://127.0.0.1:{port}", Auth(), None, retries=3)
        server = MainServer(SETTINGS, portions.send)
        try:
            server.open_round(kit.make_plan(["a"], round_id=1))
            state = server.current(1)
            await kit.joined(state, "a")
            await state.step(kit.step_req("a", 0, *kit.batch(1)))
            await asyncio.wait_for(state.closed.wait(), 10)
        finally:
            fed.close()
            server.trainers.shutdown()
        assert uploads == [b"/v1/rounds/1/server-portions"] * tries
        assert state.undelivered == [state.groups[0].group_id]
        # The portion was encoded once for every try: the group's copy was freed before the first.
        assert all(p.is_meta for p in state.groups[0].trainer.portion.parameters())
    kit.run(body)
