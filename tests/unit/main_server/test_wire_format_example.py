"""docs/wire-format.md's example step body is one the Main Server accepts: the example is run as
written and its body goes through the real decoding and validation of a step
(``GroupRound.validate_step``) for a plan of the model it describes, and its table of activation
shapes is the one the Main Server expects at every split point."""
from __future__ import annotations

import re
from pathlib import Path

from main_server.group_round import GroupRound
from shared.config import TrainConfig
from shared.models import build_model
from shared.schemas import JoinRequest, Participant, RoundPlan, StepRequest
from shared.wire import encode_state, unpackb

PAGE = Path(__file__).resolve().parents[3] / "docs" / "wire-format.md"


def _example() -> dict:
    code = re.search(r"## Example\n.*?```python\n(.*?)```", PAGE.read_text(), re.S)
    assert code is not None, "docs/wire-format.md has no python block under '## Example'"
    namespace: dict = {}
    exec(compile(code.group(1), str(PAGE), "exec"), namespace)   # its own asserts run too
    return namespace


def _plan(split_point: int) -> RoundPlan:
    # The run the example describes: the zoo's cnn on MNIST with the default training settings.
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    return RoundPlan(run_id="run", round_id=1, round_index=1, model="cnn", num_classes=10, input_shape=[1, 28, 28], seed=0,
                     participants=[Participant(device_id="dev-000", split_point=split_point, num_samples=64)],
                     server_weights=encode_state(model.portion(split_point, len(model.blocks)).state_dict()),
                     train=TrainConfig(), grouping="singleton", group_size=1, group_loss="per_member",
                     join_deadline_s=30.0, step_deadline_s=30.0)


def test_the_documented_step_body_is_accepted(kit):
    example = _example()

    async def body() -> None:
        state = GroupRound(_plan(example["split_point"]), kit.Uploads())
        await state.join(JoinRequest(device_id="dev-000", label_counts=[1] * 10, num_steps=1))
        group, batch = state.validate_step(StepRequest.model_validate(unpackb(example["body"])))
        assert batch.device_id == "dev-000" and batch.split_point == example["split_point"]
        assert tuple(batch.fx.shape) == (32, *example["ACTIVATION"][example["split_point"]])
        # The table holds the Main Server's expectation at every split point of the model.
        model = build_model("cnn", 10, (1, 28, 28), seed=0)
        assert set(example["ACTIVATION"]) == set(model.split_points)
        for k, shape in example["ACTIVATION"].items():
            assert state.checks.activation_shapes[k] == shape, k
    kit.run(body)
