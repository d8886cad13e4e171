"""Algorithm 1's edge cases, hand-computed: a smaller upload is refused, not broadcast, and a key
only a later device supplies is still averaged."""
from __future__ import annotations

import pytest
import torch

from shared.algorithms.aggregation import Contribution, check_state, layerwise_aggregate


def test_a_smaller_or_larger_upload_is_refused_not_broadcast():
    global_state = {"w": torch.zeros(2)}
    # Shape (1,) would broadcast onto (2,) in the sums; it must be an error naming the key.
    with pytest.raises(ValueError, match=r"contribution 0: client_state\['w'\] has shape \(1,\), global shape is \(2,\)"):
        layerwise_aggregate(global_state, [Contribution(1.0, {"w": torch.ones(1)})])
    with pytest.raises(ValueError, match=r"has shape \(3,\)"):
        check_state(global_state, {"w": torch.ones(3)}, "upload")
    with pytest.raises(ValueError, match=r"has shape \(\)"):
        check_state(global_state, {"w": torch.tensor(1.0)}, "upload")


def test_a_key_only_a_later_device_supplies_is_averaged_over_its_suppliers():
    global_state = {"a": torch.zeros(1), "b": torch.zeros(1)}
    first = Contribution(1.0, {"a": torch.tensor([2.0])})                        # no b at all
    second = Contribution(3.0, {"a": torch.tensor([6.0]), "b": torch.tensor([8.0])})
    out = layerwise_aggregate(global_state, [first, second])
    assert float(out["a"]) == 5.0   # (1*2 + 3*6) / 4
    assert float(out["b"]) == 8.0   # 3*8 / 3: only the second device supplies b
