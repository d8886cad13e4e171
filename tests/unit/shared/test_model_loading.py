"""Loading a model by reference: built-in names and import paths, what a function may return, the
inference of feature block / output layer, and one clear error for each bad input."""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from shared.models import SplitModel, build_model, build_model_layout, check_model_origin
from shared.run_config import load_run_config

MODULE = textwrap.dedent('''
    from collections import OrderedDict
    import torch
    from torch import nn
    from shared.models import ModelDefinition

    def sequential(num_classes, input_shape, hidden=16):
        return nn.Sequential(OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.Sequential(nn.Linear(input_shape[0], hidden), nn.ReLU()),
            head=nn.Linear(hidden, num_classes),
        ))

    def mapping(num_classes):
        return {"a": nn.Flatten(), "b": nn.Linear(20, 8), "c": nn.Sequential(nn.Dropout(0.1), nn.Linear(8, num_classes))}

    def declared(num_classes, input_shape):
        blocks = {"body": nn.Linear(input_shape[0], 8), "act": nn.ReLU(), "out": nn.Linear(8, num_classes)}
        return ModelDefinition(blocks, split_points=[2], feature_block="act", output_layer="out")

    def no_parts(num_classes):
        return {"a": nn.Linear(20, num_classes), "b": nn.ReLU()}

    def deep_head(num_classes):
        return {"a": nn.Linear(20, 8), "b": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, num_classes))}

    def flat_deep_head(num_classes, input_shape):
        flat = 1
        for d in input_shape:
            flat *= d
        return {"a": nn.Sequential(nn.Flatten(), nn.Linear(flat, 8)),
                "b": nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, num_classes))}

    def kwargs_only(**kwargs):
        return sequential(kwargs["num_classes"], kwargs["input_shape"])

    def uses_rng(num_classes, input_shape):
        torch.rand(1)
        return sequential(num_classes, input_shape)

    def one_block(num_classes):
        return nn.Sequential(nn.Linear(20, num_classes))

    def returns_none(num_classes):
        return None

    def broken_chain(num_classes):
        return nn.Sequential(OrderedDict(conv=nn.Conv2d(1, 4, 3), fc=nn.Linear(99, num_classes)))

    def wrong_output(num_classes):
        return {"a": nn.Linear(20, 8), "b": nn.Linear(8, num_classes + 1)}

    def bad_split(num_classes):
        return ModelDefinition({"a": nn.Linear(20, 8), "b": nn.Linear(8, num_classes)}, split_points=[2])

    def no_parts_no_cut(num_classes):
        return ModelDefinition({"a": nn.Linear(20, num_classes), "b": nn.ReLU()}, split_points=[])

    def raises(num_classes):
        raise RuntimeError("no GPU here")

    class Gate(nn.Module):
        """Data-dependent: cannot run on the meta device (no values there)."""
        def forward(self, x):
            return x if x.abs().sum().item() >= 0 else -x

    def needs_real(num_classes):
        return {"a": nn.Linear(20, 8), "gate": Gate(), "b": nn.Linear(8, num_classes)}

    NOT_CALLABLE = 3
''')


@pytest.fixture(autouse=True)
def user_pkg(tmp_path, monkeypatch):
    """A user package ``my_pkg.nets`` on sys.path, as the operator's environment would have it."""
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_pkg.nets", "my_pkg"):   # the next test imports its own copy
        sys.modules.pop(name, None)


def _build(name: str, **kwargs) -> SplitModel:
    return build_model(f"my_pkg.nets:{name}", kwargs.pop("num_classes", 3), (20,), **kwargs)


def test_sequential_gives_named_blocks_every_boundary_and_inferred_parts():
    model = _build("sequential")
    assert model.block_names() == ["flatten", "fc1", "head"]
    assert model.split_points == (1, 2)
    assert (model.feature_block, model.output_layer) == ("fc1", "blocks.head")
    assert model.input_shape == (20,) and model(torch.zeros(5, 20)).shape == (5, 3)
    assert model.ref == "my_pkg.nets:sequential"


def test_mapping_infers_output_layer_inside_a_sequential_after_pass_through_modules():
    model = _build("mapping")
    assert (model.feature_block, model.output_layer) == ("b", "blocks.c.1")
    assert "blocks.c.1.bias" in model.state_dict()


def test_model_definition_declares_split_points_and_parts():
    model = _build("declared")
    assert model.split_points == (2,)
    assert (model.feature_block, model.output_layer) == ("act", "blocks.out")


def test_nothing_inferred_when_the_last_block_is_no_linear_or_computes_before_it():
    assert (_build("no_parts").feature_block, _build("no_parts").output_layer) == (None, None)
    deep = _build("deep_head")
    assert (deep.feature_block, deep.output_layer) == (None, "blocks.b.2")


def test_params_are_passed_and_num_classes_input_shape_given_to_kwargs_functions():
    assert _build("sequential", params={"hidden": 7}).blocks["head"].in_features == 7
    assert _build("kwargs_only").output_layer == "blocks.head"


def test_build_is_deterministic_from_the_seed_and_leaves_the_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = _build("uses_rng", seed=4)
    assert torch.equal(torch.rand(1), expected_next)
    b, c = _build("uses_rng", seed=4), _build("uses_rng", seed=5)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["blocks.head.weight"], c.state_dict()["blocks.head.weight"])


def test_zoo_names_are_entries_of_the_same_mechanism():
    model = build_model("mobilenet", 10, (3, 32, 32), params={"width": 0.25})
    assert model.ref == "mobilenet" and model.output_layer == "blocks.head"
    assert model.blocks["head"].in_features == 256   # 1024 * 0.25


def test_a_model_that_cannot_run_on_the_meta_device_gets_its_layout_from_a_real_build():
    with torch.device("meta"), pytest.raises(ValueError, match="block 'gate'"):
        _build("needs_real")
    layout = build_model_layout("my_pkg.nets:needs_real", 3, (20,))
    assert next(layout.parameters()).is_meta and layout.block_names() == ["a", "gate", "b"]
    assert load_run_config(_config(model="my_pkg.nets:needs_real")).model == "my_pkg.nets:needs_real"
    with pytest.raises(ValueError, match="block 'fc' cannot take the output of block 'conv'"):
        build_model_layout("my_pkg.nets:broken_chain", 3, (1, 8, 8))   # a real error is still reported


def test_meta_device_build_checks_shapes_without_memory():
    with torch.device("meta"):
        model = _build("sequential")
    assert next(model.parameters()).is_meta
    with torch.device("meta"), pytest.raises(ValueError, match="block 'fc'"):
        build_model("my_pkg.nets:broken_chain", 3, (1, 8, 8))


@pytest.mark.parametrize("ref, message", [
    ("my_pkg.missing:net", "cannot import module 'my_pkg.missing'"),
    ("my_pkg.nets:nothing", "module 'my_pkg.nets' has no attribute 'nothing'"),
    ("my_pkg.nets:NOT_CALLABLE", "'NOT_CALLABLE' is not callable"),
    ("my_pkg.nets:returns_none", "returned NoneType; return an nn.Sequential"),
    ("my_pkg.nets:one_block", "needs at least two blocks"),
    ("my_pkg.nets:bad_split", "split_points must be strictly increasing within [1, 1], got [2]"),
    ("my_pkg.nets:wrong_output", "expected [1, 3]"),
    ("my_pkg.nets:raises", "building it failed: RuntimeError: no GPU here"),
    ("alexnet", "unknown model 'alexnet'"),
    ("my_pkg.nets:", "an import path is package.module:function"),
])
def test_bad_model_references_name_the_problem(ref, message):
    with pytest.raises(ValueError) as err:
        build_model(ref, 3, (20,))
    assert message in str(err.value)
    assert ref in str(err.value)


def test_bad_params_name_the_params():
    with pytest.raises(ValueError, match=r"model 'my_pkg.nets:sequential': calling it with model_params \{'depth': 2\}"):
        _build("sequential", params={"depth": 2})
    with pytest.raises(ValueError, match="may not set"):
        _build("sequential", params={"num_classes": 2})


def test_blocks_that_do_not_chain_name_the_block_and_the_shape_it_received():
    with pytest.raises(ValueError) as err:
        build_model("my_pkg.nets:broken_chain", 3, (1, 8, 8))
    assert "block 'fc' cannot take the output of block 'conv' (shape [1, 4, 6, 6])" in str(err.value)


def test_the_first_block_that_cannot_take_its_input_is_named():
    with pytest.raises(ValueError, match=r"block 'conv' cannot take the input \(shape \[1, 2, 8, 8\]\)"):
        build_model("my_pkg.nets:broken_chain", 3, (2, 8, 8))
    with pytest.raises(ValueError, match=r"block 'b' cannot take the output of block 'a' \(shape \[1, 24\]\)"):
        build_model("my_pkg.nets:mapping", 3, (24,))


def test_import_paths_only_from_the_operator():
    check_model_origin("cnn", None)                              # a built-in name from the network: fine
    check_model_origin("my_pkg.nets:declared", "my_pkg.nets:declared")
    with pytest.raises(ValueError, match="start this process with --model my_pkg.nets:declared"):
        check_model_origin("my_pkg.nets:declared", None)
    with pytest.raises(ValueError, match="never taken from the network"):
        check_model_origin("my_pkg.nets:declared", "my_pkg.nets:sequential")


def _config(**overrides):
    data = {"algorithm": "fedavg", "model": "my_pkg.nets:sequential", "rounds": 1,
            "data": {"dataset": "local", "num_classes": 3, "input_shape": [20], "num_devices": 2}}
    data.update(overrides)
    return data


def test_run_config_builds_the_model_and_reports_its_errors():
    assert load_run_config(_config()).model == "my_pkg.nets:sequential"
    with pytest.raises(ValueError, match="cannot take the output of block 'conv'"):
        load_run_config(_config(model="my_pkg.nets:broken_chain",
                                data={"dataset": "local", "num_classes": 3, "input_shape": [1, 8, 8]}))


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": "fnr-fl", "model": "my_pkg.nets:flat_deep_head", "data": {"dataset": "mnist", "public_samples": 10}},
     "algorithm 'fnr-fl' needs the model's penultimate feature block"),
    ({"algorithm": "fedipg", "model": "my_pkg.nets:no_parts", "algorithm_params": {"penalty_scope": "head"}},
     "return ModelDefinition(..., output_layer=...)"),
    ({"selection": "hics", "model": "my_pkg.nets:no_parts"}, "selection 'hics' needs the model's output layer"),
    ({"algorithm": "s2fl", "model": "my_pkg.nets:no_parts_no_cut"}, "declares no split points"),
])
def test_algorithms_needing_undeclared_parts_fail_at_start(overrides, message):
    with pytest.raises(ValueError) as err:
        load_run_config(_config(**overrides))
    assert message in str(err.value)


def test_a_model_without_parts_is_fine_for_algorithms_that_do_not_need_them():
    assert load_run_config(_config(model="my_pkg.nets:no_parts")).model == "my_pkg.nets:no_parts"
