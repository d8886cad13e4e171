"""An ordinary nn.Module with its own forward as a user model: traced with torch.fx, cut where one
tensor is live, its chain checked against the module, its exported keys the user's own."""
from __future__ import annotations

import copy
import json
import sys
import textwrap

import pytest
import torch

from shared.models import ModelDefinition, build_model, build_model_layout, model_fingerprint, profile_model
from shared.models.export import export_model, load_trained
from shared.models.loading import _split_model
from shared.run_config import load_run_config

MODULE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn
    from shared.models import ModelDefinition


    class CNN(nn.Module):
        def __init__(self, num_classes=10, width=8):
            super().__init__()
            self.conv1 = nn.Conv2d(1, width, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(2 * width)
            self.fc = nn.Linear(2 * width * 7 * 7, num_classes)
            self.spare = nn.Linear(4, 4)          # never used by forward: exported all the same

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
            x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
            return self.fc(torch.flatten(x, 1))


    class Basic(nn.Module):
        def __init__(self, cin, cout, stride=1):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Sequential()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + self.shortcut(x))


    class ResNet(nn.Module):
        def __init__(self, num_classes=10):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.layer1 = nn.Sequential(Basic(8, 8), Basic(8, 8))
            self.layer2 = nn.Sequential(Basic(8, 16, 2))
            self.fc = nn.Linear(16, num_classes)

        def forward(self, x, return_features=False):
            x = F.relu(self.bn1(self.conv1(x)))
            x = self.layer2(self.layer1(x))
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
            return x if return_features else self.fc(x)


    class TwoLayers(nn.Module):
        def __init__(self, num_classes=10):
            super().__init__()
            self.a = nn.Linear(20, 8)
            self.b = nn.Linear(8, num_classes)


    class Branchy(TwoLayers):
        def forward(self, x):
            h = self.a(x)
            if h.sum() > 0:
                h = -h
            return self.b(h)


    class Reused(nn.Module):
        """fc1 runs twice: no cut may fall between its two uses."""
        def __init__(self, num_classes=10):
            super().__init__()
            self.fc1 = nn.Linear(20, 20)
            self.fc2 = nn.Linear(20, 20)
            self.head = nn.Linear(20, num_classes)

        def forward(self, x):
            h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
            return self.head(torch.relu(self.fc1(h)))


    class Tied(nn.Module):
        """The output layer is the input layer's weight: the whole forward is one block."""
        def __init__(self, num_classes=20):
            super().__init__()
            self.inp = nn.Linear(20, 20)
            self.mid = nn.Linear(20, 20)

        def forward(self, x):
            return F.linear(torch.relu(self.mid(torch.relu(self.inp(x)))), self.inp.weight)


    class TrainingFlag(TwoLayers):
        def forward(self, x):
            return self.b(F.dropout(self.a(x), 0.5, self.training))


    class OneLayer(nn.Module):
        def __init__(self, num_classes=10):
            super().__init__()
            self.fc = nn.Linear(20, num_classes)

        def forward(self, x):
            return torch.relu(self.fc(x.flatten(1)))


    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(20, 8)

        def forward(self, x, y):
            return self.a(x) + y


    def cnn(num_classes, width=8):
        return CNN(num_classes, width)

    def resnet(num_classes):
        return ResNet(num_classes)

    def declared(num_classes):
        return ModelDefinition(CNN(num_classes), split_points=[2], output_layer="fc")

    def branchy(num_classes):
        return Branchy(num_classes)

    def reused(num_classes):
        return Reused(num_classes)

    def tied(num_classes):
        return Tied(num_classes)

    def training_flag(num_classes):
        return TrainingFlag(num_classes)

    def one_layer(num_classes):
        return OneLayer(num_classes)

    def two_inputs(num_classes):
        return TwoInputs()
''')

MNIST = (1, 28, 28)


@pytest.fixture(autouse=True)
def user_module(tmp_path, monkeypatch):
    """The user's module ``traced_nets`` on sys.path, as the operator's environment would have it."""
    (tmp_path / "traced_nets.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("traced_nets", None)   # the next test imports its own copy


def _nets():
    import traced_nets
    return traced_nets


def _same_output(model, net, x) -> bool:
    model.eval()
    net.eval()
    with torch.no_grad():
        return torch.allclose(model(x), net(x), atol=1e-6)


def test_a_cnn_with_its_own_forward_is_cut_after_each_stage_and_reproduces_the_module():
    model = build_model("traced_nets:cnn", 10, MNIST, seed=3)
    assert model.block_names() == ["conv1", "conv2", "fc"]   # conv-bn-relu-pool, conv-bn-relu-pool-flatten, fc
    assert model.split_points == (1, 2)
    assert (model.feature_block, model.output_layer) == ("conv2", "blocks.fc.fc")
    assert [k for k in model.state_dict() if k.startswith("blocks.conv1.")] == [
        "blocks.conv1.conv1.weight", "blocks.conv1.conv1.bias", "blocks.conv1.bn1.weight", "blocks.conv1.bn1.bias",
        "blocks.conv1.bn1.running_mean", "blocks.conv1.bn1.running_var", "blocks.conv1.bn1.num_batches_tracked"]
    x = torch.randn(4, *MNIST)
    with torch.no_grad():
        # the activation at split point 2 is the pooled, flattened map: what the output layer takes
        assert model.forward_blocks(x, 0, 2).shape == (4, 16 * 7 * 7)
        assert torch.equal(model.features(x), model.forward_blocks(x, 0, 2))
    assert model.source is not None and _same_output(model, model.source, x)


def test_a_residual_net_is_never_cut_inside_a_residual_block():
    model = build_model("traced_nets:resnet", 10, (3, 16, 16))
    assert model.block_names() == ["conv1", "layer1_0", "layer1_1", "layer2_0", "fc"]
    assert (model.feature_block, model.output_layer) == ("layer2_0", "blocks.fc.fc")
    x = torch.randn(3, 3, 16, 16)
    net = _nets().ResNet(10)
    net.load_state_dict({k.split(".", 2)[2]: v for k, v in model.state_dict().items()})
    assert _same_output(model, net, x)
    with torch.no_grad():   # each block's input is the previous residual block's output, one tensor
        h = model.forward_blocks(x, 0, 2)
        assert torch.equal(h, net.layer1[0](torch.relu(net.bn1(net.conv1(x)))))
    block = model.blocks["layer2_0"]   # the downsampling shortcut is inside the block that adds it
    assert {"layer2.0.conv1.weight", "layer2.0.shortcut.0.weight", "layer2.0.shortcut.1.running_var"} <= set(block.state_dict())


def test_a_module_that_cannot_be_traced_is_one_line_saying_where_and_what_to_do():
    with pytest.raises(ValueError) as err:
        build_model("traced_nets:branchy", 10, (20,))
    message = str(err.value)
    assert message.startswith("model 'traced_nets:branchy': Branchy.forward cannot be traced by torch.fx at traced_nets.py:")
    assert "cannot be used as inputs to control flow" in message and "return an nn.Sequential" in message
    assert "\n" not in message and err.value.__cause__ is None and err.value.__suppress_context__


def test_a_module_reused_in_the_forward_is_not_cut_between_its_uses():
    model = build_model("traced_nets:reused", 10, (20,))
    assert model.block_names() == ["fc1", "head"]   # fc1, fc2, fc1 again: one block
    assert "blocks.fc1.fc1.weight" in model.state_dict() and "blocks.fc1.fc2.weight" in model.state_dict()
    assert _same_output(model, model.source, torch.randn(5, 20))


def test_a_parameter_tied_across_the_whole_forward_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"Tied.forward cannot be cut into two blocks: parameter 'inp.weight' is used "
                                         r"on both sides of every possible cut"):
        build_model("traced_nets:tied", 20, (20,))


def test_a_forward_that_reads_self_training_is_refused_by_the_output_check():
    with pytest.raises(ValueError, match="the blocks traced from TrainingFlag.forward do not reproduce its output "
                                         r"\(largest difference .*\).*reads self.training"):
        build_model("traced_nets:training_flag", 10, (20,))


def test_forward_takes_one_tensor_of_the_input_shape_and_has_two_layers_to_cut_between():
    with pytest.raises(ValueError, match=r"TwoInputs.forward takes 2 input\(s\) without a default \(x, y\)"):
        build_model("traced_nets:two_inputs", 10, (20,))
    with pytest.raises(ValueError, match=r"model 'traced_nets:cnn': CNN.forward fails on a batch of shape \[2, 20\]: "):
        build_model("traced_nets:cnn", 10, (20,))
    with pytest.raises(ValueError, match=r"OneLayer.forward cannot be cut into two blocks: no point between two layers "
                                         r"with parameters \(1 found\) has exactly one tensor live"):
        build_model("traced_nets:one_layer", 10, (20,))


def test_declared_split_points_and_output_layer_name_the_users_module():
    model = build_model("traced_nets:declared", 10, MNIST)
    assert model.split_points == (2,) and model.output_layer == "blocks.fc.fc" and model.feature_block is None
    with pytest.raises(ValueError, match="output_layer 'head' is not a module the forward uses"):
        _split_model("ref", ModelDefinition(_nets().CNN(), output_layer="head"), 10, MNIST)


def test_exported_keys_are_the_users_and_load_strictly_into_a_fresh_instance(tmp_path):
    model = build_model("traced_nets:cnn", 10, MNIST, seed=0)
    model.train()
    model(torch.randn(8, *MNIST)).sum().backward()   # BatchNorm's running stats move in training
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert state["blocks.conv1.bn1.num_batches_tracked"] == 1
    done = export_model(model, state, tmp_path, ["pt", "safetensors"],
                        {"model": "traced_nets:cnn", "num_classes": 10, "input_shape": list(MNIST)})
    assert set(done.files) == {"pt", "safetensors"}
    fresh = _nets().CNN(10)
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(weights) == list(fresh.state_dict()) == json.loads((tmp_path / "model.json").read_text())["keys"]
    fresh.load_state_dict(weights, strict=True)
    assert torch.equal(fresh.bn1.running_mean, state["blocks.conv1.bn1.running_mean"])
    unused = build_model("traced_nets:cnn", 10, MNIST, seed=0).source.spare.weight   # in no block: as built
    assert torch.equal(weights["spare.weight"], unused)
    x = torch.randn(3, *MNIST)
    assert _same_output(model, fresh, x)
    loaded = load_trained(tmp_path)
    assert type(loaded).__name__ == "CNN" and not loaded.training and _same_output(model, loaded, x)


def test_fingerprint_and_profile_work_on_the_blocks_and_on_the_meta_layout():
    spec = load_run_config({"model": "traced_nets:cnn", "data": {"dataset": "mnist"}}).data
    model = build_model("traced_nets:cnn", 10, MNIST)
    layout = build_model_layout("traced_nets:cnn", 10, MNIST)
    assert next(layout.parameters()).is_meta and layout.block_names() == model.block_names()
    assert model_fingerprint(layout, spec) == model_fingerprint(model, spec)
    profile = profile_model(model, "traced")
    assert [s.k for s in profile.splits] == [1, 2]
    conv_flops = 2 * 2 * 8 * 9 * 28 * 28 + 2 * 2 * 16 * 8 * 9 * 14 * 14   # forward + weight gradient, per sample
    assert profile.splits[1].client_flops >= conv_flops and profile.splits[1].server_flops > 0
    assert profile.splits[1].client_flops + profile.splits[1].server_flops == profile.total_flops
    assert profile.splits[0].activation_bytes == 8 * 14 * 14 * 4 and profile.splits[1].activation_bytes == 16 * 7 * 7 * 4
    device_copy = copy.deepcopy(layout)   # what a device agent trains: a copy of the layout, materialised per portion
    portion = device_copy.portion(0, 2)
    portion.to_empty(device=torch.device("cpu"))
    portion.load_state_dict({k: model.state_dict()[k] for k in model.portion_keys(0, 2)})
    with torch.no_grad():
        assert torch.equal(portion.eval()(torch.ones(2, *MNIST)), model.eval().forward_blocks(torch.ones(2, *MNIST), 0, 2))
