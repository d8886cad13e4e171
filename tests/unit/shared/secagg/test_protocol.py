"""One attempt's stages in memory: the Fed Server's unmasked sum equals the weighted sum of the
devices' clipped updates within the fixed-point rounding, with one device dropped after sharing
(its pairwise masks removed through its rebuilt mask key) and one silent in the unmasking stage
(its own mask removed through its rebuilt seed); too few answers fail; a forged share, or one not
the share its sender committed to, is named; a secret other than its owner committed to is refused; a
device refuses what would expose its update (a roster repeating a key, too few sharers or
survivors), as SecAgg+'s client does."""
import os
import random

import numpy as np
import pytest

from shared.secagg.crypto import MASK_PURPOSE, ShareError
from shared.secagg.encoding import decode, fraction_bits
from shared.secagg.graph import neighbourhoods
from shared.secagg.masks import BlockLayout, add_masks
from shared.secagg.protocol import (
    DEALT_SHARE_BYTES, SEALED_SHARE_BYTES, Committed, DealingError, DeviceSecrets, rebuild_secrets, unmasked_sum,
)
from shared.secagg.shamir import PRIME, SHARE_BYTES

LAYOUT = BlockLayout(((("w", (4, 3)), ("b", (3,))), (("v", (7,)),)))
DEVICES = ["d0", "d1", "d2", "d3", "d4"]
WEIGHTS = {"d0": 10.0, "d1": 20.0, "d2": 5.0, "d3": 40.0, "d4": 25.0}
RANGE = 0.5


COMPLETE = {d: DEVICES for d in DEVICES}
WHOLE = {d: len(LAYOUT.blocks) for d in DEVICES}


def _committed(secrets: dict[str, DeviceSecrets]) -> Committed:
    """What the devices committed to, as the Fed Server holds it."""
    return Committed("run", 3, {d: s.seed_commitment() for d, s in secrets.items()},
                     {d: s.public_keys()[0] for d, s in secrets.items()})


def _attempt(silent: set[str], unmask_answers: int | None = None, graph: dict[str, list[str]] = COMPLETE,
             threshold: int = 3, dropped: str = "d1", splits: dict[str, int] = WHOLE, layout: BlockLayout = LAYOUT):
    """One attempt over ``graph`` (each device's neighbourhood), each device holding the blocks
    before its split point (and ``layout``'s head): ``dropped`` shares, then never uploads;
    ``silent`` upload but do not answer the unmasking stage."""
    rng = np.random.default_rng(7)
    secrets = {d: DeviceSecrets(d, "run", 3) for d in DEVICES}
    keys_of = {d: s.public_keys() for d, s in secrets.items()}
    rosters = {d: {n: keys_of[n] for n in graph[d]} for d in DEVICES}
    sealed = {d: s.seal_shares(rosters[d], threshold=threshold) for d, s in secrets.items()}
    partners = {d: s.open_inbox(rosters[d], {o: sealed[o][d] for o in graph[d] if o != d})
                for d, s in secrets.items()}
    bits = fraction_bits(sum(WEIGHTS.values()), RANGE)
    updates = {d: {k: rng.uniform(-0.8, 0.8, size=shape) for b in layout.held(splits[d]) for k, shape in layout.blocks[b]}
               for d in DEVICES}
    uploaders = [d for d in DEVICES if d != dropped]
    masked = {d: secrets[d].mask(updates[d], WEIGHTS[d], bits, RANGE, layout, rosters[d], partners[d], splits)
              for d in uploaders}
    answering = [d for d in uploaders if d not in silent][:unmask_answers]
    answers = {d: secrets[d].unmask(uploaders, [dropped]) for d in answering}
    seeds, keys = rebuild_secrets(answers, graph, uploaders, [dropped], threshold, _committed(secrets))
    total = unmasked_sum(masked, layout, seeds, keys, {d: keys_of[d][0] for d in DEVICES}, graph, splits)
    expected = {k: sum(WEIGHTS[d] * np.clip(updates[d][k], -RANGE, RANGE) for d in uploaders if k in updates[d])
                for block in layout.blocks for k, _ in block}
    return total, expected, bits, masked, updates


def test_the_unmasked_sum_is_the_weighted_sum_of_the_clipped_updates_despite_dropouts():
    total, expected, bits, masked, updates = _attempt(silent={"d3"})
    # Each device rounds once; decoding 64-bit words into float64 rounds once more (53 bits).
    bound = len(masked) / 2.0 ** (bits + 1) + 2.0 ** -52 * sum(WEIGHTS.values()) * RANGE
    for key in expected:
        np.testing.assert_allclose(decode(total[key], bits), expected[key], atol=bound, rtol=0)
    # What the Fed Server holds of one device is not its update: decoded alone, its entries spread
    # over the whole 64-bit range (+-128 here), far outside the +-5 its weighed update lies in.
    alone = np.concatenate([decode(masked["d0"][k], bits).ravel() for k in ("w", "b", "v")])
    assert np.abs(alone).max() > 10 * WEIGHTS["d0"] * RANGE


def test_with_mixed_split_points_each_block_sums_over_the_devices_that_hold_it():
    # d0 and d2 hold block 0 only, the others both blocks; d1 (both blocks) drops after sharing:
    # block 1's sum is d3's and d4's, block 0's every survivor's.
    splits = {"d0": 1, "d1": 2, "d2": 1, "d3": 2, "d4": 2}
    total, expected, bits, masked, _ = _attempt(silent=set(), splits=splits)
    assert sorted(masked["d0"]) == ["b", "w"] and sorted(masked["d3"]) == ["b", "v", "w"]
    bound = len(masked) / 2.0 ** (bits + 1) + 2.0 ** -52 * sum(WEIGHTS.values()) * RANGE
    assert sorted(total) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(decode(total[key], bits), expected[key], atol=bound, rtol=0)


def test_u_shaped_devices_mask_their_head_with_their_front_blocks_and_it_sums_over_all_of_them():
    # Three blocks, the last the devices' head: d0 and d2 hold block 0 and the head, the others
    # blocks 0 and 1 and the head; the middle block 1 is summed over d3 and d4 only (d1 drops).
    layout = BlockLayout(((("w", (4, 3)), ("b", (3,))), (("v", (7,)),), (("h", (2, 5)), ("c", (2,)))), head_start=2)
    assert layout.held(1) == [0, 2] and layout.held(2) == [0, 1, 2] and layout.held_keys(1) == ["w", "b", "h", "c"]
    splits = {"d0": 1, "d1": 2, "d2": 1, "d3": 2, "d4": 2}
    total, expected, bits, masked, _ = _attempt(silent={"d4"}, splits=splits, layout=layout)
    assert sorted(masked["d0"]) == ["b", "c", "h", "w"]
    # The head is masked as the front blocks are: alone, it decodes to noise over the 64-bit range.
    assert np.abs(decode(masked["d0"]["h"], bits)).max() > 10 * WEIGHTS["d0"] * RANGE
    bound = len(masked) / 2.0 ** (bits + 1) + 2.0 ** -52 * sum(WEIGHTS.values()) * RANGE
    assert sorted(total) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(decode(total[key], bits), expected[key], atol=bound, rtol=0)


def test_on_a_sparse_graph_the_unmasked_sum_is_the_same_despite_dropouts():
    # A ring of five with two neighbours each: d1's masks are in its two neighbours' words only,
    # and every secret is rebuilt from two of its neighbourhood's three shares.
    graph = neighbourhoods(DEVICES, 2, random.Random(3))
    assert all(len(graph[d]) == 3 for d in DEVICES) and graph != COMPLETE
    total, expected, bits, masked, _ = _attempt(silent=set(), graph=graph, threshold=2)
    bound = len(masked) / 2.0 ** (bits + 1) + 2.0 ** -52 * sum(WEIGHTS.values()) * RANGE
    for key in expected:
        np.testing.assert_allclose(decode(total[key], bits), expected[key], atol=bound, rtol=0)


def test_on_a_sparse_graph_a_neighbourhood_with_too_few_answers_rebuilds_nothing():
    # One of the dropped device's two neighbours is silent: its neighbourhood has one survivor
    # that answers, which cannot rebuild the secrets of that silent neighbour (or d1's).
    graph = neighbourhoods(DEVICES, 2, random.Random(3))
    others = [d for d in graph["d1"] if d != "d1"]
    with pytest.raises(ValueError, match="1 shares of .* below the threshold 2"):
        _attempt(silent={others[0]}, graph=graph, threshold=2)


def test_fewer_answers_than_the_threshold_rebuild_nothing():
    with pytest.raises(ValueError, match="below the threshold 3"):
        _attempt(silent=set(), unmask_answers=2)


def _flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def _answered() -> tuple[dict[str, DeviceSecrets], list[str], dict]:
    """The five devices' secrets over the complete graph (threshold 3) once they shared, the four
    that uploaded (d1 dropped) and their unmasking answers."""
    secrets = {d: DeviceSecrets(d, "run", 3) for d in DEVICES}
    roster = {d: s.public_keys() for d, s in secrets.items()}
    sealed = {d: s.seal_shares(roster, threshold=3) for d, s in secrets.items()}
    for d, s in secrets.items():
        s.open_inbox(roster, {o: sealed[o][d] for o in DEVICES if o != d})
    uploaders = ["d0", "d2", "d3", "d4"]
    return secrets, uploaders, {d: secrets[d].unmask(uploaders, ["d1"]) for d in uploaders}


def test_a_share_that_does_not_verify_or_is_not_the_one_committed_to_is_refused_naming_its_sender():
    a, b = DeviceSecrets("a", "run", 1), DeviceSecrets("b", "run", 1)
    roster = {"a": a.public_keys(), "b": b.public_keys()}
    dealt = a.seal_shares(roster, threshold=2)["b"]
    b.seal_shares(roster, threshold=2)
    assert len(dealt) == DEALT_SHARE_BYTES
    with pytest.raises(ShareError, match="the share from 'a' does not decrypt"):
        b.open_inbox(roster, {"a": _flipped(dealt, SEALED_SHARE_BYTES - 1)})
    for at in (SEALED_SHARE_BYTES, DEALT_SHARE_BYTES - 1):   # the seed share's commitment, the key share's
        with pytest.raises(ShareError, match="the share from 'a' is not the one it committed to"):
            b.open_inbox(roster, {"a": _flipped(dealt, at)})
    assert list(b.held) == ["b"]
    assert b.open_inbox(roster, {"a": dealt}) == ["a", "b"]


def test_the_fed_server_refuses_a_secret_other_than_the_one_its_owner_committed_to():
    # A share moved by one at index 3 of {1, 2, 3} (whose Lagrange coefficient at 0 is 1) rebuilds
    # the seed plus one: a secret of the right size, which only the commitment tells wrong. An
    # owner dealing such a share passes its recipient's check (it commits to what it deals).
    secrets, uploaders, answers = _answered()
    moved = {d: (dict(s), dict(k)) for d, (s, k) in answers.items()}
    for owner, part in (("d0", 0), ("d4", 0), ("d1", 1)):
        share = moved["d3"][part][owner]
        moved["d3"][part][owner] = ((int.from_bytes(share, "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big")
    with pytest.raises(DealingError, match="the shares of d0, d4, d1 rebuild no secret they committed to") as raised:
        rebuild_secrets(moved, COMPLETE, uploaders, ["d1"], 3, _committed(secrets))
    assert raised.value.owners == ["d0", "d4", "d1"]


def test_an_owner_that_misdealt_is_named_even_where_another_secret_has_too_few_shares():
    secrets, uploaders, answers = _answered()
    moved = {d: (dict(s), dict(k)) for d, (s, k) in answers.items() if d != "d4"}   # d4 silent
    share = moved["d3"][0]["d2"]
    moved["d3"][0]["d2"] = ((int.from_bytes(share, "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big")
    sparse = {**COMPLETE, "d0": ["d0", "d1", "d4"]}   # d0's secret: only its own share comes back
    with pytest.raises(DealingError, match="the shares of d2 rebuild no secret"):
        rebuild_secrets(moved, sparse, uploaders, ["d1"], 3, _committed(secrets))
    with pytest.raises(ValueError, match="1 shares of 'd0''s secret came back, below the threshold 3"):
        rebuild_secrets({d: a for d, a in answers.items() if d != "d4"}, sparse, uploaders, ["d1"], 3,
                        _committed(secrets))


def test_a_device_named_both_survivor_and_dropped_gives_no_share():
    a = DeviceSecrets("a", "run", 1)
    a.seal_shares({"a": a.public_keys(), "b": DeviceSecrets("b", "run", 1).public_keys()}, threshold=2)
    with pytest.raises(ValueError, match="both"):
        a.unmask(["a", "b"], ["b"])


def test_a_secret_is_rebuilt_from_exactly_threshold_shares_the_lowest_indices():
    # Four answers (d0, d2, d3, d4: indices 1, 3, 4, 5), threshold 3: the share of index 5 is not
    # used, so a wrong one there changes nothing (interpolating it too would only cost time).
    secrets, uploaders, answers = _answered()
    seeds, keys = rebuild_secrets(answers, COMPLETE, uploaders, ["d1"], 3, _committed(secrets))
    assert seeds == {d: secrets[d].seed for d in uploaders} and keys == {"d1": secrets["d1"].mask_private}
    wrong = {d: (dict(s), dict(k)) for d, (s, k) in answers.items()}
    wrong["d4"][0]["d0"] = os.urandom(SHARE_BYTES - 1).rjust(SHARE_BYTES, b"\0")
    assert rebuild_secrets(wrong, COMPLETE, uploaders, ["d1"], 3, _committed(secrets))[0]["d0"] == secrets["d0"].seed
    wrong["d0"][0]["d0"] = wrong["d4"][0]["d0"]   # index 1 is among the three used: no 16-byte seed
    with pytest.raises(DealingError, match="the shares of d0 rebuild no secret"):
        rebuild_secrets(wrong, COMPLETE, uploaders, ["d1"], 3, _committed(secrets))


def test_a_roster_key_that_agrees_on_nothing_is_refused_before_any_share_is_sealed():
    a, b, c = (DeviceSecrets(d, "run", 1) for d in "abc")
    roster = {"a": a.public_keys(), "b": b.public_keys(), "c": (bytes(32), c.public_keys()[1])}
    with pytest.raises(ShareError, match="agrees on nothing"):
        a.seal_shares(roster, threshold=2)
    assert a.held == {}


def test_each_key_agreement_is_made_once_an_attempt_and_the_sealing_key_opens_the_share(monkeypatch):
    import shared.secagg.protocol as protocol

    secrets = {d: DeviceSecrets(d, "run", 1) for d in DEVICES}
    roster = {d: s.public_keys() for d, s in secrets.items()}
    sealed = {d: s.seal_shares(roster, threshold=3) for d, s in secrets.items()}
    made = []
    monkeypatch.setattr(protocol, "agree", lambda *args: made.append(args) or b"")
    d0 = secrets["d0"]
    partners = d0.open_inbox(roster, {o: sealed[o]["d0"] for o in DEVICES if o != "d0"})
    d0.mask({"w": np.zeros((4, 3)), "b": np.zeros(3), "v": np.zeros(7)}, 1.0, 40, RANGE, LAYOUT, roster, partners,
            WHOLE)
    assert partners == DEVICES and made == []      # opened and masked with the keys agreed when sealing


def test_a_roster_that_repeats_a_key_or_misstates_the_devices_own_is_refused_before_any_share_is_sealed():
    a, b, c = (DeviceSecrets(d, "run", 1) for d in "abc")
    honest = {"a": a.public_keys(), "b": b.public_keys(), "c": c.public_keys()}
    colluding = {**honest, "c": (b.public_keys()[0], c.public_keys()[1])}      # c sends b's mask key
    with pytest.raises(ShareError, match=r"repeats a public key among \['b', 'c'\]"):
        a.seal_shares(colluding, threshold=2)
    with pytest.raises(ShareError, match=r"repeats a public key among \['c'\]"):
        a.seal_shares({**honest, "c": (c.public_keys()[1],) * 2}, threshold=2)
    with pytest.raises(ShareError, match="does not hold 'a' with its own public keys"):
        a.seal_shares({**honest, "a": b.public_keys()}, threshold=2)
    assert a.held == {} and a.threshold == 0
    # Why: c's key is b's, so a agrees one mask with both and, sorting between them, adds it for
    # one and subtracts it for the other: its upload would be its update under its own mask alone.
    key = a._agree(b.public_keys()[0], MASK_PURPOSE)
    words = {"w": np.arange(12, dtype=np.uint64).reshape(4, 3), "b": np.arange(3, dtype=np.uint64),
             "v": np.arange(7, dtype=np.uint64)}
    alone = add_masks({k: v.copy() for k, v in words.items()}, LAYOUT, "b1", 2, a.seed, {})
    cancelled = add_masks({k: v.copy() for k, v in words.items()}, LAYOUT, "b1", 2, a.seed,
                          {"a0": (key, 2), "c2": (key, 2)})
    assert all(np.array_equal(alone[k], cancelled[k]) for k in words)


def test_a_device_fewer_than_threshold_of_whose_neighbourhood_shared_masks_nothing():
    secrets = {d: DeviceSecrets(d, "run", 1) for d in "abcd"}
    roster = {d: s.public_keys() for d, s in secrets.items()}
    sealed = {d: s.seal_shares(roster, threshold=3) for d, s in secrets.items()}
    with pytest.raises(ShareError, match=r"2 devices of 'a''s neighbourhood shared, itself included, below the threshold 3"):
        secrets["a"].open_inbox(roster, {"b": sealed["b"]["a"]})
    assert secrets["a"].open_inbox(roster, {"b": sealed["b"]["a"], "c": sealed["c"]["a"]}) == ["a", "b", "c"]


def test_a_device_answers_no_unmasking_question_naming_fewer_survivors_than_the_threshold():
    secrets = {d: DeviceSecrets(d, "run", 1) for d in "abcd"}
    roster = {d: s.public_keys() for d, s in secrets.items()}
    sealed = {d: s.seal_shares(roster, threshold=3) for d, s in secrets.items()}
    a = secrets["a"]
    a.open_inbox(roster, {o: sealed[o]["a"] for o in "bcd"})
    with pytest.raises(ShareError, match="2 devices of 'a''s neighbourhood survived, below the threshold 3"):
        a.unmask(["a", "b", "stranger"], ["c", "d"])      # a survivor outside its neighbourhood counts for nothing
    seeds, keys = a.unmask(["a", "b", "c"], ["d"])
    assert sorted(seeds) == ["a", "b", "c"] and sorted(keys) == ["d"]


def test_a_device_masks_no_block_that_fewer_than_threshold_of_the_devices_it_masks_with_mask():
    secrets = {d: DeviceSecrets(d, "run", 1) for d in "abc"}
    roster = {d: s.public_keys() for d, s in secrets.items()}
    sealed = {d: s.seal_shares(roster, threshold=2) for d, s in secrets.items()}
    a = secrets["a"]
    partners = a.open_inbox(roster, {o: sealed[o]["a"] for o in "bc"})
    update = {"w": np.zeros((4, 3)), "b": np.zeros(3), "v": np.zeros(7)}
    with pytest.raises(ShareError, match="block 1 of 'a' is masked by fewer than 2 of the devices it masks with"):
        a.mask(update, 1.0, 40, RANGE, LAYOUT, roster, partners, {"a": 2, "b": 1, "c": 1})
    a.mask(update, 1.0, 40, RANGE, LAYOUT, roster, partners, {"a": 2, "b": 1, "c": 2})
