"""A ResNet-style model written as one class (skip connections and BatchNorm inside its forward),
traced and cut: split training at every cut gives the gradients, and the BatchNorm statistics, of
training the whole module in one process.

Split training as the services run it: the device runs the blocks before the cut, the activation
crosses (detached, a leaf that needs a gradient), the server runs the rest and the loss and
backpropagates, and the activation's gradient comes back to the device, which backpropagates it
through its blocks. BatchNorm in train mode normalises with the batch's own statistics, so the
same batch on both sides must give the same gradients and the same running statistics; in eval
mode the running statistics are used and left as they are."""
from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from shared.models import build_model
from shared.models.tracing import trace_blocks
from user_models import OneClassResNet

REF = "user_models:one_class_resnet"
SHAPE = (3, 16, 16)


def _user_key(key: str) -> str:
    return key.split(".", 2)[2]   # blocks.<block>.<the user's key>


def _whole(model, train: bool, x: torch.Tensor, y: torch.Tensor) -> OneClassResNet:
    """The user's module with ``model``'s weights, one step of backward on the whole of it."""
    net = OneClassResNet(10, SHAPE, width=4)
    net.load_state_dict({_user_key(k): v for k, v in model.state_dict().items()}, strict=True)
    net.train(train)
    F.cross_entropy(net(x), y).backward()
    return net


def _split(model, k: int, train: bool, x: torch.Tensor, y: torch.Tensor):
    """A copy of ``model`` after one split step at cut ``k``."""
    model = copy.deepcopy(model).train(train)
    n = len(model.block_names())
    sent = model.forward_blocks(x, 0, k)                  # the device's blocks
    received = sent.detach().requires_grad_(True)          # what crosses the network
    F.cross_entropy(model.forward_blocks(received, k, n), y).backward()   # the server's blocks and the loss
    assert received.grad is not None
    sent.backward(received.grad)                           # the activation's gradient, back on the device
    return model


def test_the_one_class_resnet_is_cut_between_its_residual_stages_only():
    model = build_model(REF, 10, SHAPE, seed=0)
    assert model.block_names() == ["stem", "a_conv1", "b_short", "c_short", "fc"]
    assert model.split_points == (1, 2, 3, 4)
    # each stage, its skip connection with it, is one block
    assert {"a_conv1.weight", "a_conv2.weight", "a_bn2.running_mean"} <= set(model.blocks["a_conv1"].state_dict())
    assert {"b_short.weight", "b_conv1.weight", "b_conv2.weight", "b_bn2.running_var"} <= set(model.blocks["b_short"].state_dict())


@pytest.mark.parametrize("train", [True, False], ids=["batchnorm-train", "eval"])
def test_split_training_at_every_cut_gives_the_whole_models_gradients(train):
    model = build_model(REF, 10, SHAPE, seed=4)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, *SHAPE, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    if not train:   # running statistics that are not the initial ones, so eval mode uses something
        with torch.no_grad():
            model.train()(torch.randn(32, *SHAPE, generator=generator) * 2 + 1)
    whole = _whole(model, train, x, y)
    reference = dict(whole.named_parameters())
    buffers = dict(whole.named_buffers())
    for k in model.split_points:
        split = _split(model, k, train, x, y)
        params = dict(split.named_parameters())
        assert {_user_key(name) for name in params} == set(reference)
        for name, p in params.items():
            want = reference[_user_key(name)].grad
            assert p.grad is not None and want is not None, name
            assert want.abs().sum() > 0, name   # every parameter takes part
            assert torch.allclose(p.grad, want, rtol=1e-5, atol=1e-7), (k, name, (p.grad - want).abs().max())
        for name, b in split.named_buffers():   # BatchNorm's statistics: updated once, the same way
            assert torch.allclose(b, buffers[_user_key(name)], rtol=1e-6, atol=1e-7), (k, name)


def test_a_module_another_thread_runs_while_one_is_traced_runs_as_usual():
    """torch.fx patches nn.Module.__call__ for the whole process while it traces: an agent whose
    device threads build and check their models at once must not have one thread's modules reach
    another thread's trace."""
    tracing, ran = threading.Event(), threading.Event()

    class Pausing(torch.nn.Module):   # its forward waits, mid-trace, until the other thread has run
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x))
            if not tracing.is_set():
                tracing.set()
                assert ran.wait(30)
            return self.b(h)

    other = OneClassResNet(10, SHAPE).eval()
    x = torch.randn(2, *SHAPE)
    with torch.no_grad():
        want = other(x)
    results: list = []

    def run_other() -> None:
        assert tracing.wait(30)
        try:
            with torch.no_grad():
                results.append(other(x))
        except Exception as exc:   # noqa: BLE001 - what the other thread met is the finding
            results.append(exc)
        ran.set()

    thread = threading.Thread(target=run_other)
    thread.start()
    traced = trace_blocks(Pausing(), (6,))
    thread.join(30)
    assert len(results) == 1 and isinstance(results[0], torch.Tensor), results
    assert torch.equal(results[0], want) and list(traced.blocks) == ["a", "b"]
    with ThreadPoolExecutor(3) as pool:   # three devices building the one-class ResNet at once
        models = list(pool.map(lambda seed: build_model(REF, 10, SHAPE, seed=seed), range(3)))
    assert all(m.block_names() == ["stem", "a_conv1", "b_short", "c_short", "fc"] for m in models)
