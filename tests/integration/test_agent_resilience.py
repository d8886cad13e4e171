"""One device's failing tasks stop neither its agent nor the run: an agent through the real servers.

A real Fed Server and Main Server (FedAvg and S2FL, cnn) and one real agent hosting two devices in
this process. ``dev-001`` receives every training task with an algorithm name its agent does not
know (what a task it cannot build looks like to it; the agent's session client rewrites the task
as it arrives).
It must give each task up and withdraw from the attempt, while the agent's other device trains
every round to the end of the run, and the Fed Server's round records must say that ``dev-001``
withdrew and why. Under S2FL the Main Server is told at once, so the round waits neither for the
withdrawn device's join nor for its upload.
"""
from __future__ import annotations

import threading

import pytest

from device_agent.agent import Agent
from device_agent.clients import HttpFedClient
from integration_support import final_status, server_pair, small_config
from shared.schemas import AgentTaskRequest, AgentTaskResponse

ROUNDS = 2


class UnbuildableTasks(HttpFedClient):
    """The agent's session client: hands ``dev-001`` every training task with an algorithm it does
    not know."""

    def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
        answer = super().agent_tasks(agent_id, req)
        for device_task in answer.tasks:
            task = device_task.task
            if device_task.device_id == "dev-001" and task.status == "train" and task.phase == "train":
                device_task.task = task.model_copy(update={"algorithm": "no-such-algorithm"})
        return answer


#: Deadlines long next to a round of this size (seconds): waiting for the withdrawn device's join or
#: upload would show in the round time.
JOIN_S = ROUND_S = 60.0


@pytest.mark.parametrize("algorithm", ["fedavg", "s2fl"])
def test_a_device_whose_tasks_fail_withdraws_and_its_agents_other_device_trains_to_the_end(algorithm):
    config = small_config(algorithm=algorithm, rounds=ROUNDS, **{
        "data.num_devices": 2, "data.max_samples": 400, "train.batch_size": 32, "deadlines.round_s": ROUND_S,
        "deadlines.join_s": JOIN_S})
    with server_pair(config, "agent-resilience") as servers:
        agent = Agent(servers.fed_url, [0, 1], None, compute_slots=0)
        agent.tasks_fed = UnbuildableTasks(servers.fed_url, retries=0)
        code: list[int] = []
        thread = threading.Thread(target=lambda: code.append(agent.run()), daemon=True)
        thread.start()
        status = final_status(servers.fed_url, 240)
        thread.join(60)
        if thread.is_alive():
            agent.stop.set()
            thread.join(30)
        logs = servers.fed.log_tail(40) + "\n" + servers.main.log_tail(20)

    assert status["state"] == "finished" and status["driver_error"] is None, (status, logs)
    # The agent ended with the run, no device of it stopped by an error.
    assert code == [0] and agent.errors == {}, (code, agent.errors)
    assert [d.tasks_trained for d in agent.devices] == [ROUNDS, 0]
    ok = [r for r in status["history"] if r["status"] == "ok"]
    assert [r["round"] for r in ok] == list(range(1, ROUNDS + 1)), status["history"]
    for record in ok:
        assert record["aggregated"] == ["dev-000"], record
        assert record["round_time_s"] < JOIN_S / 2, record
        reason = record["left"]["dev-001"]
        assert reason.startswith("withdrew: ") and "'no-such-algorithm' is not one this agent knows" in reason, record
