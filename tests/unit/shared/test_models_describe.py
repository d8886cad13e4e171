"""docs/builtin-models.md is generated from the zoo (``python -m shared.models.describe``): the
committed page must be what the code gives today, so the documented activation shapes, parameters
and FLOPs cannot drift from the models."""
from __future__ import annotations

import torch

from shared.models import build_model
from shared.models.describe import MODELS, PAGE, describe_block, render


def test_the_committed_page_is_what_the_zoo_gives():
    assert PAGE.read_text() == render(), "run: python -m shared.models.describe --write"


def test_every_split_point_row_holds_the_activation_the_device_sends():
    # The probe the page's split tables rest on, checked independently of the page's text: the
    # shape printed for split point k is the output of running the first k blocks.
    page = PAGE.read_text()
    for name, (_, inputs) in MODELS.items():
        for input_shape, _ in inputs:
            model = build_model(name, 10, input_shape, seed=0).eval()
            heading = f"### {name} on [{', '.join(map(str, input_shape))}]"
            section = page[page.index(heading):].split("\n### ", 1)[0].split("\n## ", 1)[0]
            for k in model.split_points:
                with torch.no_grad():
                    shape = tuple(model.forward_blocks(torch.zeros(1, *input_shape), 0, k).shape[1:])
                devices = ", ".join(f"`{n}`" for n in list(model.blocks)[:k])
                assert f"| {k} | {devices} | [{', '.join(map(str, shape))}] |" in section, (name, input_shape, k)


def test_block_descriptions_name_the_layers():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    assert describe_block(model.blocks["conv1"]) == "conv5x5 1->32 p2, ReLU, maxpool2"
    assert describe_block(model.blocks["head"]) == "linear 512->10"
    stage3 = build_model("mobilenet", 10, (3, 32, 32), seed=0).blocks["stage3"]
    assert describe_block(stage3) == "dwsep 128->256 s2, 5x dwsep 256->256"
