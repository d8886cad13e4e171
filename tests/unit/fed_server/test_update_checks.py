"""Update-norm checks: hand-computed norms, clipping into the ball, integer buffers untouched."""
import math

import torch

from fed_server.update_checks import clip_update, update_norm


def test_update_norm_hand_computed():
    g = {"a": torch.zeros(2), "b": torch.ones(1), "n": torch.tensor(5)}
    s = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([5.0]), "n": torch.tensor(9)}
    assert update_norm(s, g) == 5.0  # sqrt(3^2 + 4^2); the integer buffer does not count


def test_clip_scales_the_update_onto_the_norm_ball():
    g = {"a": torch.ones(2), "n": torch.tensor(5)}
    s = {"a": torch.tensor([4.0, 5.0]), "n": torch.tensor(9)}  # update (3, 4), norm 5
    clipped = clip_update(s, g, 1.0)
    assert torch.allclose(clipped["a"], torch.tensor([1.6, 1.8]))
    assert math.isclose(update_norm(clipped, g), 1.0, rel_tol=1e-6)
    assert clipped["n"] is s["n"]
    assert clip_update(s, g, 10.0)["a"] is s["a"]  # inside the ball: unchanged
