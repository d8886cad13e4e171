"""``split.candidates``: which of a model's split points the planner chooses among. A deep traced
model has a split point at every layer boundary (mobilenet_v3_small: 27), and S2FL's warm-up takes
a round per candidate."""
from __future__ import annotations

import sys
import textwrap

import pytest

from shared.models import ModelProfile, SplitCost, build_model_layout, candidate_split_points, profile_model
from shared.run_config import ConfigError, load_run_config


def _profile(activations: list[int], name: str = "deep") -> ModelProfile:
    """A profile whose split point k (1-based) sends ``activations[k - 1]`` bytes a sample."""
    return ModelProfile(name, 0, 0.0, tuple(SplitCost(k, 0, 0, a, 0.0, 0.0) for k, a in enumerate(activations, 1)))


def test_none_keeps_every_split_point_and_a_list_keeps_those():
    profile = _profile([8, 4, 2, 1])
    assert candidate_split_points(profile, None) == [1, 2, 3, 4]
    assert candidate_split_points(profile, [1, 4]) == [1, 4]


def test_a_number_takes_the_smallest_activation_of_each_stretch_of_the_model():
    # 27 split points in four stretches (1-6, 7-13, 14-20, 21-27); each stretch's smallest
    # activation, the earlier of equal ones: spread from shallow to deep, each the cheapest to send.
    activations = [9, 9, 5, 9, 9, 9,   7, 3, 7, 7, 3, 7, 7,   6, 6, 6, 6, 2, 6, 6,   4, 4, 4, 4, 4, 4, 1]
    assert len(activations) == 27
    assert candidate_split_points(_profile(activations), 4) == [3, 8, 18, 27]
    assert candidate_split_points(_profile(activations), 1) == [27]
    assert candidate_split_points(_profile(activations), 27) == list(range(1, 28))


@pytest.mark.parametrize("setting, message", [
    (28, "split.candidates: 28 cut points, but model 'deep' has 27 split point(s) (1-27): give at most 27"),
    ([0, 5, 30], "split.candidates: [0, 30] are not split points of model 'deep' (its split points: 1-27)"),
    ([28], "split.candidates: [28] is not a split point of model 'deep' (its split points: 1-27)"),
    ([5, 2], "split.candidates: [5, 2]: list split points once each, in increasing order"),
    ([2, 2], "split.candidates: [2, 2]: list split points once each, in increasing order"),
])
def test_a_setting_the_model_cannot_meet_is_one_line(setting, message):
    with pytest.raises(ValueError) as refused:
        candidate_split_points(_profile([1] * 27), setting)
    assert str(refused.value) == message


DEEP = textwrap.dedent("""
    import torch
    from torch import nn

    class Deep(nn.Module):
        \"\"\"A plain deep network written as one class: tracing cuts it at every layer boundary.\"\"\"

        def __init__(self, num_classes, input_shape):
            super().__init__()
            widths = [input_shape[0], 8, 8, 16, 16, 32, 32, 32, 64]
            self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, stride=2 if b != a else 1, padding=1)
                                       for a, b in zip(widths, widths[1:]))
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x):
            for conv in self.convs:
                x = torch.relu(conv(x))
            return self.fc(x.mean(dim=(2, 3)))
""")


@pytest.fixture
def deep_nets(tmp_path, monkeypatch):
    """The user's module ``deep_nets`` on sys.path, as the operator's environment would have it."""
    (tmp_path / "deep_nets.py").write_text(DEEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "deep_nets:Deep"
    sys.modules.pop("deep_nets", None)


def test_a_traced_deep_model_gets_the_cheap_cuts_spread_over_it(deep_nets):
    model = build_model_layout(deep_nets, 10, (1, 28, 28))
    profile = profile_model(model, deep_nets)
    points = list(model.split_points)
    assert len(points) >= 8, points
    chosen = candidate_split_points(profile, 3)
    assert len(chosen) == 3 and chosen == sorted(chosen) and set(chosen) <= set(points)
    activation = {s.k: s.activation_bytes for s in profile.splits}
    # the deepest stretch's cheapest cut is the smallest activation of the whole model
    assert activation[chosen[-1]] == min(activation.values())


def test_the_configuration_check_refuses_what_the_model_cannot_meet_in_one_line(deep_nets):
    # The run's configuration is checked against the model it builds, before any process starts.
    base = {"algorithm": "s2fl", "model": deep_nets}
    assert load_run_config({**base, "split": {"candidates": 3}}).split.candidates == 3
    for setting, words in ((40, "split.candidates: 40 cut points, but model 'deep_nets:Deep' has"),
                           ([2, 99], "split.candidates: [99] is not a split point of model 'deep_nets:Deep'"),
                           ("four", "split.candidates: a number of cut points (at least 1) or a list")):
        with pytest.raises(ConfigError) as refused:
            load_run_config({**base, "split": {"candidates": setting}})
        (line,) = refused.value.lines
        assert line.startswith(words), line


def test_a_pinned_split_point_must_be_a_candidate_of_the_run():
    assert load_run_config({"algorithm": "s2fl", "split": {"pinned": {"dev-000": 2}}}).split.pinned == {"dev-000": 2}
    with pytest.raises(ConfigError, match=r"split.pinned: dev-001: 2 is not one of the run's candidate split points \[1, 3\]"):
        load_run_config({"algorithm": "s2fl", "split": {"candidates": [1, 3], "pinned": {"dev-000": 3, "dev-001": 2}}})
