"""Update norms and clipping: hand-computed norms, clipping into the ball (integer buffers
untouched), a clipped update never over the bound, and the adaptive bound's steps."""
import math

import pytest
import torch

from shared.privacy.clipping import AdaptiveClip, clip_update, update_norm


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


def test_a_clipped_update_never_exceeds_the_bound():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        scale = float(torch.empty(1).exponential_(generator=generator)) * 10 ** (trial % 7 - 3)
        start = {"w": torch.randn(7, 3, generator=generator), "b": torch.randn(3, generator=generator),
                 "steps": torch.tensor(4)}
        state = {"w": start["w"] + torch.randn(7, 3, generator=generator) * scale,
                 "b": start["b"] + torch.randn(3, generator=generator) * scale, "steps": torch.tensor(12)}
        bound = float(torch.rand(1, generator=generator)) + 1e-3
        clipped = clip_update(state, start, bound)
        # float32 entries: the clipped update's norm is the bound up to float32 rounding.
        assert update_norm(clipped, start) <= bound * (1 + 1e-5)
        assert clipped["steps"] is state["steps"]
        if update_norm(state, start) <= bound:
            assert clipped["w"] is state["w"]


def test_adaptive_clipping_moves_the_bound_towards_the_quantile():
    clip = AdaptiveClip(clip_norm=1.0, quantile=0.5, lr=0.2, count_stddev=1.0)
    clip.observe(1.0)     # every update was inside: the bound shrinks
    assert clip.clip_norm == pytest.approx(math.exp(-0.1))
    clip.observe(0.0)     # none was: it grows back
    assert clip.clip_norm == pytest.approx(1.0)
    # Andrew et al.'s split of the multiplier: z_update^-2 + (2 sigma_b)^-2 = z^-2.
    z = clip.update_noise_multiplier(1.0)
    assert z ** -2 + (2 * 1.0) ** -2 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        AdaptiveClip(1.0, 0.5, 0.2, count_stddev=0.4).update_noise_multiplier(1.0)
