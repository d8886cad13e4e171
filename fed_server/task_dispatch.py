"""What a polling device is told to do (wait, train, its follow-up, evaluate, done), and the
weights those tasks name, published once for every device that fetches them."""
from __future__ import annotations

import time
from collections.abc import Callable, Collection

from fed_server.evaluation_round import EvaluationRound
from fed_server.fed_round import FedRound
from fed_server.run_core import RunCore
from shared.algorithms.two_phase import two_phase
from shared.errors import Invalid
from shared.schemas import TaskResponse, WeightsId

# How soon a waiting device should poll again. Devices not in the running round have nothing to do
# until the next one: with 100 devices and 10 per round, polling them as often as the participants
# cost more CPU than the training on a small machine.
IDLE_RETRY_S = 1.0
SOON_RETRY_S = 0.2

#: The longest a device's task request may wait for work (``GET .../task?wait_s=``): long enough that
#: an idle device asks a few times a minute, short enough that a server shutting down is not held.
MAX_TASK_WAIT_S = 30.0


class TaskDispatch:
    """Answers task polls and publishes the weights they name."""

    def __init__(self, core: RunCore, device_url: Callable[[str], str] = str) -> None:
        """``device_url``: the address a device is told for a Main Server replica
        (:meth:`fed_server.replica_planning.ReplicaPlanning.device_url`)."""
        self.core = core
        self.device_url = device_url
        # The open attempt's client portions by split point, published once for all the devices that
        # train it (FedAvg: one encoding of the whole model a round, not one per device).
        self._task_weights: tuple[int, dict[int, WeightsId]] = (0, {})
        self._evaluation_weights: WeightsId | None = None  # the evaluated global model, once per phase
        self._done_answer: TaskResponse | None = None  # the final answer, polled by every device

    def open_tasks(self, fed_round: FedRound) -> None:
        """The round's plans are out (or it has none): its devices may now get their tasks."""
        fed_round.ready = True
        fed_round.ready_at = time.monotonic()
        self.core.post_work()

    async def next_task(self, device_id: str, wait_s: float = 0.0) -> TaskResponse:
        """:meth:`task_for`, but a ``wait`` answer is held for up to ``wait_s`` seconds until work is
        posted for the device (long-poll): a device learns of its task when the round opens, not at
        its next poll (:meth:`Broadcast.hold`: work posted while the answer is computed is never
        missed)."""
        if not 0.0 <= wait_s <= MAX_TASK_WAIT_S:
            raise Invalid(f"wait_s must be between 0 and {MAX_TASK_WAIT_S:g} seconds, got {wait_s}")
        return await self.core.work_posted.hold(lambda: self.task_for(device_id),
                                                lambda answer: answer.status != "wait", wait_s)

    def with_work(self, idle: Collection[str]) -> list[str]:
        """Which of the ``idle`` devices may have a task now (:meth:`task_for` tells): all of them
        once the run is done; else the devices asked to evaluate and the open attempt's devices
        (not its follow-ups: a device asks for the follow-up of its own task itself). Costs the
        round's size, not the population's, except once at the end."""
        core = self.core
        if core.finished:
            return list(idle)
        candidates: dict[str, None] = {}
        if core.evaluating is not None:
            candidates.update((device_id, None) for device_id in core.evaluating.asked if device_id in idle)
        fed_round = core.round
        if fed_round is not None and fed_round.ready and fed_round.follow_ups is None:
            candidates.update((device_id, None) for device_id in fed_round.assignments if device_id in idle)
        return list(candidates)

    def task_for(self, device_id: str) -> TaskResponse:
        """A polling device's next instruction.

        Every device, selected or not, is told the final global model's ``weights_id`` when the
        run is done; a device that keeps its model fetches it, a virtual one does not. A device
        taken out of the attempt before it took its task gets none: its upload would be refused, and
        the replica its task names may be gone.
        """
        core = self.core
        core.devices.get(device_id)
        if core.finished:
            if self._done_answer is None:
                self._done_answer = TaskResponse(status="done", num_blocks=core.num_blocks,
                                                 weights_id=core.weights.publish(core.portion(core.num_blocks)))
            return self._done_answer
        if core.evaluating is not None and device_id in core.evaluating.asked:
            return self._evaluation_task(core.evaluating, device_id)
        fed_round = core.round
        if fed_round is None or not fed_round.ready:
            # Before the first round nothing is imminent; between rounds the next task is.
            return TaskResponse(status="wait", retry_after_s=IDLE_RETRY_S if core.started_at is None else SOON_RETRY_S)
        if device_id not in fed_round.assignments:
            return TaskResponse(status="wait", retry_after_s=IDLE_RETRY_S)
        if fed_round.follow_ups is not None:
            return self._follow_up_for(fed_round, device_id)
        if fed_round.assignments[device_id].dispatched_at is not None:  # one task per device and round; a follow-up may come
            return TaskResponse(status="wait", retry_after_s=SOON_RETRY_S)
        if device_id in fed_round.excluded:   # taken out before its task (it registered again, its replica was lost)
            return TaskResponse(status="wait", retry_after_s=IDLE_RETRY_S)
        return self._training_task(fed_round, device_id)

    def _training_task(self, fed_round: FedRound, device_id: str) -> TaskResponse:
        """A selected device's one task of the attempt: its split and the client portion."""
        core, config = self.core, self.core.config
        assignment = fed_round.assignments[device_id]
        assignment.dispatched_at = time.monotonic()
        return TaskResponse(
            status="train", round_id=fed_round.round_id, round_index=fed_round.index,
            split_point=assignment.split_point, num_blocks=core.num_blocks,
            head_start=core.head_start if fed_round.uses_main_server and core.head_start < core.num_blocks else None,
            weights_id=self._client_portion(fed_round, assignment.split_point), train=config.train,
            main_server_url=self.device_url(assignment.main_server_url)
            if fed_round.uses_main_server and assignment.main_server_url else None,
            deadline_s=fed_round.remaining_s(), half_precision=config.half_precision,
            algorithm=config.algorithm, params=core.algorithm.device_params(),
            extras=core.algorithm.task_extras(device_id, fed_round.context).to_wire(),
            report=two_phase(core.algorithm) is not None,
            privacy=core.privacy.task_terms() if core.privacy is not None else None,
            secure_aggregation=fed_round.secure.terms if fed_round.secure is not None else None,
        )

    def count_task_bytes(self, answer: TaskResponse, body_bytes: int) -> None:
        """Count a task sent in its attempt's (or evaluation phase's) bytes down: its body with the
        weights it names, whether the device's agent fetches them or already holds them for another
        of its devices: the algorithm's traffic per device, as with one device per agent (docs/api.md)."""
        core = self.core
        sent = body_bytes + (core.weights.size(answer.weights_id) if answer.weights_id else 0)
        if answer.status == "train" and core.round is not None:
            core.round.task_bytes += sent
        elif answer.status == "evaluate" and core.evaluating is not None:
            core.evaluating.task_bytes += sent

    def _client_portion(self, fed_round: FedRound, split_point: int) -> WeightsId:
        """Blocks ``[0, split_point)`` of the global model (and U-shaped, the head), published once
        per attempt and split point (the model does not change while an attempt is open)."""
        round_id, portions = self._task_weights
        if round_id != fed_round.round_id:
            self.release_task_weights()
            portions = {}
            self._task_weights = (fed_round.round_id, portions)
        if split_point not in portions:
            portions[split_point] = self.core.weights.publish(
                self.core.device_portion(split_point) if fed_round.uses_main_server else self.core.portion(split_point))
        return portions[split_point]

    def release_task_weights(self) -> None:
        """The attempt's portions are no longer served: its tasks have ended (or the model is about
        to change)."""
        for weights_id in self._task_weights[1].values():
            self.core.weights.release(weights_id)
        self._task_weights = (0, {})

    def release_evaluation_weights(self) -> None:
        """The evaluated model is no longer served: its phase ended (or a new one begins)."""
        if self._evaluation_weights is not None:
            self.core.weights.release(self._evaluation_weights)
            self._evaluation_weights = None

    def _follow_up_for(self, fed_round: FedRound, device_id: str) -> TaskResponse:
        assert fed_round.follow_ups is not None
        if device_id not in fed_round.follow_ups or device_id in fed_round.follow_ups_sent:
            return TaskResponse(status="wait", retry_after_s=SOON_RETRY_S)
        fed_round.follow_ups_sent.add(device_id)
        return TaskResponse(status="train", phase="follow_up", round_id=fed_round.round_id, round_index=fed_round.index,
                            deadline_s=fed_round.remaining_s(), algorithm=self.core.config.algorithm,
                            extras=fed_round.follow_ups[device_id].to_wire())

    def _evaluation_task(self, evaluation: EvaluationRound, device_id: str) -> TaskResponse:
        """Federated evaluation: the whole new global model, once per asked device."""
        if device_id in evaluation.dispatched or device_id in evaluation.reports:
            return TaskResponse(status="wait", retry_after_s=SOON_RETRY_S)
        evaluation.dispatched.add(device_id)
        core = self.core
        if self._evaluation_weights is None:   # published once for every asked device
            self._evaluation_weights = core.weights.publish(core.portion(core.num_blocks))
        remaining = max(1.0, evaluation.deadline() - time.monotonic())
        return TaskResponse(status="evaluate", round_id=evaluation.round_id, round_index=evaluation.index,
                            num_blocks=core.num_blocks,
                            weights_id=self._evaluation_weights, deadline_s=remaining)
