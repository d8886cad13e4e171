"""Upload checks: the claims (sample count, timings) against what the Fed Server knows."""
import numpy as np
import pytest

from fed_server.update_checks import (
    MAX_TRAIN_LOSS, check_claims, held_out_count, max_held_out, table_time,
)
from shared.data.holdout import holdout_split
from shared.errors import Invalid
from shared.schemas import DeviceTimings, UpdateRequest


def _timings(**changes) -> DeviceTimings:
    return DeviceTimings(**{"compute_s": 1.0, "transfer_s": 0.5, "wait_s": 0.2, "server_s": 0.3, "total_s": 2.5, **changes})


def _upload(num_samples: int = 50, train_loss: float = 1.5, **timings) -> UpdateRequest:
    return UpdateRequest(device_id="d", round_id=1, num_samples=num_samples, steps=1, train_loss=train_loss,
                         weights={}, timings=_timings(**timings), bytes_up=0, bytes_down=0)


def test_claims_within_the_bounds_and_matching_the_registration_pass():
    check_claims(_upload(), 50, deadline_s=2.5)
    check_claims(_upload(compute_s=10.0, transfer_s=0.0, server_s=0.0, total_s=10.0), 50, deadline_s=10.0)
    check_claims(_upload(train_loss=-MAX_TRAIN_LOSS), 50, deadline_s=10.0)
    check_claims(_upload(train_loss=MAX_TRAIN_LOSS), 50, deadline_s=10.0)


@pytest.mark.parametrize("claimed", [49, 51, 10**12])
def test_a_sample_count_other_than_the_registered_one_is_invalid(claimed):
    with pytest.raises(Invalid, match=f"num_samples={claimed} of 'd' differs from the 50 samples"):
        check_claims(_upload(num_samples=claimed), 50, deadline_s=100.0)


@pytest.mark.parametrize("changes, match", [
    ({"compute_s": 1e308, "transfer_s": 1e308}, "timings.compute_s=1e[+]308s"),
    ({"compute_s": 4.0, "transfer_s": 4.0, "server_s": 4.0}, "compute_s [+] transfer_s [+] server_s = 12s"),
    ({"wait_s": 10.5}, "timings.wait_s=10.5s"),
    ({"total_s": 11.0}, "timings.total_s=11s"),
])
def test_timings_beyond_the_round_deadline_are_invalid(changes, match):
    with pytest.raises(Invalid, match=match + ".*deadline of 10s"):
        check_claims(_upload(**changes), 50, deadline_s=10.0)


@pytest.mark.parametrize("loss", [1e308, -1e308, MAX_TRAIN_LOSS * 1.01])
def test_a_training_loss_beyond_the_bound_is_invalid(loss):
    with pytest.raises(Invalid, match="train_loss=.* is beyond"):
        check_claims(_upload(train_loss=loss), 50, deadline_s=10.0)


def test_table_time_is_the_sum_of_the_device_own_costs():
    assert table_time(_timings()) == pytest.approx(1.8)   # compute + transfer + server, not the barrier wait
    assert table_time(_timings(compute_s=0.0, transfer_s=0.0, server_s=0.0)) > 0
    # The upload the Fed Server timed (the device's figures travel inside it) is part of the round.
    assert table_time(_timings(), upload_s=0.7) == pytest.approx(2.5)


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.25, 0.3, 1 / 3, 0.5, 0.7, 0.95])
def test_held_out_counts_are_the_devices_own_split_and_the_bound_is_exact(fraction):
    # The Fed Server's figures come from the function the devices split their data with.
    largest: dict[int, int] = {}   # training count -> the most held out over every n that leaves it
    for n in range(0, 400):
        train, held = holdout_split(np.arange(n) % 7, fraction, seed=n)
        assert held_out_count(n, fraction) == len(held)
        largest[len(train)] = max(largest.get(len(train), 0), len(held))
    for train_samples, held in largest.items():
        if train_samples + held < 399 - 1 / (1 - fraction):   # every n that leaves it was tried
            assert max_held_out(train_samples, fraction) == held, train_samples
    assert held_out_count(10, None) == 0
