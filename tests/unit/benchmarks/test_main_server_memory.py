"""(i)'s model and run: torchvision's ResNet-18 written out here (torchvision is not installed),
cut right after its stem, so the Main Server trains nearly all of it; the run is a configuration
the check accepts, every device at that one cut."""
from __future__ import annotations

import torch

from benchmarks.main_server_memory import MODEL, ResNet18, bench_config, fixed_cut, report, sizes
from shared.models import build_model_layout, profile_model


def test_the_model_is_resnet18_sized_and_the_cut_leaves_nearly_all_of_it_on_the_main_server():
    # torchvision.models.resnet18() has 11,689,512 parameters (1000 classes, 3 input channels).
    assert sum(p.numel() for p in ResNet18(1000, (3, 224, 224)).parameters()) == 11_689_512
    model = build_model_layout(MODEL, 10, (3, 32, 32))
    cut = fixed_cut(model.split_points, model.block_names())
    assert model.block_names()[:cut] == ["conv1"] and model.block_names()[cut] == "layer1_0"
    profile = profile_model(model, MODEL)
    assert profile.cost(cut).server_param_bytes > 0.99 * profile.total_param_bytes
    config = bench_config(3, 2, cut)   # checked as a run is: the model is built and the cut is one of its split points
    assert (config.split.sliding, config.split.candidates, config.algorithm) == (False, [cut], "s2fl")
    with torch.no_grad():
        assert ResNet18(10, (3, 32, 32))(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_the_report_shows_each_population_against_the_goal():
    run = {"devices": 3, "groups": 1, "rounds_ok": 3, "main_server_base_rss_mib": 330.0, "main_server_peak_rss_mib": 493.0,
           "main_server_rss_after_round_mib": [484.0, 491.0, 365.0], "portions_above_base": 3.81, "goal_met": True}
    lines = report({"model": "ResNet-18", "input_shape": [3, 32, 32], "split_point": 1, "server_portion_mib": 42.7,
                    "goal_portions_above_base": 4.0, "runs": [run]}).splitlines()
    assert lines[-1].split() == ["3", "1", "3", "330", "493", "3.81", "484", "491", "365", "met"]
    assert sizes(quick=True) == ((3,), 2) and sizes(quick=False) == ((3, 10), 3)
