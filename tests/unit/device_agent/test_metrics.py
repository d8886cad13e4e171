"""The agent's optional metrics port: documented series, fed from uploads; off by default."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from device_agent.metrics import METRICS, SCRAPE_HEADER, AgentMetrics
from shared.http_metrics import spec_mismatches
from shared.schemas import DeviceTimings, UpdateRequest
from testbed.processes import free_port

ROOT = Path(__file__).resolve().parents[3]


def update(device: str = "dev-001", round_id: int = 2) -> UpdateRequest:
    return UpdateRequest(device_id=device, round_id=round_id, num_samples=10, steps=3, train_loss=0.5, weights={},
                         timings=DeviceTimings(compute_s=1.0, transfer_s=0.25, wait_s=0.5, server_s=0.1, total_s=2.0),
                         bytes_up=300, bytes_down=200)


def test_exports_documented_metrics_and_serves_them():
    metrics = AgentMetrics()
    metrics.add_device("dev-001")
    metrics.observe_upload(update(), split_point=2)
    assert spec_mismatches(metrics.registry, METRICS) == []
    value = metrics.registry.get_sample_value
    assert value("sfl_device_round_seconds", {"device": "dev-001", "phase": "total"}) == 2.0
    assert value("sfl_device_split_point", {"device": "dev-001"}) == 2
    assert value("sfl_device_main_server_bytes_total", {"device": "dev-001", "direction": "sent"}) == 300

    port = free_port()
    server, thread = metrics.serve(port)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'sfl_device_rounds_completed_total{device="dev-001"} 1.0' in text
    finally:
        server.shutdown()
        server.server_close()


def test_waiting_for_a_scrape_ends_at_prometheus_s_next_scrape_not_at_another_get():
    metrics = AgentMetrics()
    port = free_port()
    server, _ = metrics.serve(port)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        httpx.get(url, headers={SCRAPE_HEADER: "4"}, timeout=5)   # before the wait: does not count
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(metrics.wait_for_scrape(30.0)))
        waiter.start()
        assert httpx.get(url, timeout=5).status_code == 200       # a health check's GET: no header
        waiter.join(0.5)
        assert waiter.is_alive() and outcome == []
        assert httpx.get(url, headers={SCRAPE_HEADER: "4"}, timeout=5).status_code == 200
        waiter.join(10)
        assert outcome == [True]
        assert metrics.wait_for_scrape(0.05) is False              # none came: the bound ends it
    finally:
        server.shutdown()
        server.server_close()


def test_waiting_for_a_scrape_ends_only_once_its_answer_is_written():
    metrics = AgentMetrics()
    collecting, release = threading.Event(), threading.Event()

    class Slow:
        """A collector that holds the scrape's answer until released."""

        def describe(self):   # registering asks this instead of collecting
            return []

        def collect(self):
            collecting.set()
            release.wait(10)
            return iter(())
    port = free_port()
    server, _ = metrics.serve(port)
    metrics.registry.register(Slow())
    try:
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(metrics.wait_for_scrape(30.0)))
        waiter.start()
        answers: list[int] = []
        scrape = threading.Thread(target=lambda: answers.append(httpx.get(
            f"http://127.0.0.1:{port}/metrics", headers={SCRAPE_HEADER: "4"}, timeout=20).status_code))
        scrape.start()
        assert collecting.wait(10)
        waiter.join(0.5)
        assert waiter.is_alive() and outcome == []   # the scrape arrived; its answer is not written yet
        release.set()
        scrape.join(20)
        waiter.join(10)
        assert answers == [200] and outcome == [True]
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def test_an_agent_exiting_after_its_last_scrape_delivers_the_answer_whole():
    """A process that exits as soon as the wait ends, as the agent does: the scrape still gets its
    whole answer (exiting when the request came in cut it off, and Prometheus saw the agent down)."""
    port = free_port()
    program = ("import sys; from device_agent.metrics import AgentMetrics; m = AgentMetrics(); m.add_device('dev-001'); "
               f"m.serve({port}); print('serving', flush=True); sys.exit(0 if m.wait_for_scrape(30) else 1)")
    process = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "serving"
        answer = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={SCRAPE_HEADER: "4"}, timeout=10)
        assert answer.status_code == 200
        assert 'sfl_device_rounds_completed_total{device="dev-001"} 0.0' in answer.text
        assert process.wait(10) == 0
    finally:
        process.kill()
        process.wait()


def test_an_answer_counts_as_sent_only_when_written_whole():
    from device_agent.metrics import _AfterSent

    sent: list[str] = []
    whole = _AfterSent([b"a", b"b"], lambda: sent.append("whole"))
    assert list(whole) == [b"a", b"b"]   # wsgiref asks for more after writing the last piece
    whole.close()
    cut = _AfterSent([b"a", b"b"], lambda: sent.append("cut"))
    pieces = iter(cut)
    next(pieces)                          # the write of the first piece failed: no more asked
    cut.close()
    assert sent == ["whole"]


def test_metrics_port_is_off_by_default(agent_cli):
    assert agent_cli.built_with(["--shards", "0"])["metrics"] is None


def test_metrics_port_flag_serves(monkeypatch, agent_cli):
    served = []
    monkeypatch.setattr(AgentMetrics, "serve", lambda self, port, host="127.0.0.1": served.append((port, host)))
    kwargs = agent_cli.built_with(["--shards", "0", "--metrics-port", "9100", "--metrics-host", "0.0.0.0"])
    assert isinstance(kwargs["metrics"], AgentMetrics)
    assert served == [(9100, "0.0.0.0")]


@pytest.mark.parametrize("linger, waits", [([], []), (["--metrics-linger-s", "12"], [12.0])])
def test_the_agent_waits_for_a_last_scrape_only_when_asked(monkeypatch, agent_cli, linger, waits):
    waited: list[float] = []
    monkeypatch.setattr(AgentMetrics, "serve", lambda self, port, host="127.0.0.1": None)
    monkeypatch.setattr(AgentMetrics, "wait_for_scrape", lambda self, timeout_s: waited.append(timeout_s) or True)
    with pytest.raises(SystemExit) as exit_:
        agent_cli.run(["--shards", "0", "--metrics-port", "9100", *linger],
                      lambda *a, **k: type("Done", (), {"run": lambda self: 3})())
    assert exit_.value.code == 3 and waited == waits   # the run's exit code either way


def test_a_stop_while_lingering_ends_the_wait_with_the_run_s_exit_code(monkeypatch, agent_cli):
    def interrupted(self, timeout_s):
        raise KeyboardInterrupt   # what SIGTERM raises in the main thread (interrupt_on_sigterm)
    monkeypatch.setattr(AgentMetrics, "serve", lambda self, port, host="127.0.0.1": None)
    monkeypatch.setattr(AgentMetrics, "wait_for_scrape", interrupted)
    with pytest.raises(SystemExit) as exit_:
        agent_cli.run(["--shards", "0", "--metrics-port", "9100", "--metrics-linger-s", "30"],
                      lambda *a, **k: type("Done", (), {"run": lambda self: 0})())
    assert exit_.value.code == 0


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_a_bad_linger_is_refused(agent_cli, bad):
    with pytest.raises(SystemExit) as exit_:
        agent_cli.built_with(["--shards", "0", "--metrics-linger-s", bad])
    assert exit_.value.code == 2


def test_agent_feeds_metrics_from_the_devices_uploads():
    """Agent(metrics=...) hooks every device's on_upload: uploads give the split and the timings."""
    from device_agent.agent import Agent

    metrics = AgentMetrics()
    agent = Agent("http://127.0.0.1:9", [1], None, metrics=metrics)
    device = agent.devices[0]
    assert device.on_upload is not None
    device.on_upload(update("dev-001", 2), 3)
    value = metrics.registry.get_sample_value
    assert value("sfl_device_split_point", {"device": "dev-001"}) == 3
    assert value("sfl_device_last_round", {"device": "dev-001"}) == 2
    assert value("sfl_device_rounds_completed_total", {"device": "dev-001"}) == 1
