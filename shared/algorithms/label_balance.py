"""Data-balance grouping of the Main Server (S2FL paper, Section 3.2, Eq. 2).

The Main Server groups the devices of a round so that each group's *combined* label
distribution is as close to uniform as possible; one copy of the server portion is then
trained per group on the union of the members' features.

Eq. 2 (distance of one group G from the uniform distribution over n classes)::

    Dist(G) = sqrt( sum_{i=1..n} ( sum_{c in G} |D_c^(i)| / sum_{p in G} |D_p|  -  1/n )^2 )

The paper says neither how many groups to form nor how to search; this module fixes both:

* group count ``G = ceil(num_devices / group_size)`` (a configured group *size*), and group
  sizes that differ by at most one;
* a deterministic heuristic (:func:`balanced_groups`): a seeded greedy assignment followed by
  best-improvement local search (pairwise swaps, plus single moves that keep the size rule)
  on the summed Eq. 2 distance.

Conventions (the paper is silent on them):

* a group with no members, or whose members hold no samples at all, has distance ``0.0``
  (there is no distribution to be unbalanced; such a group adds nothing to a union batch);
* :func:`balanced_groups` returns ``[]`` for zero devices.

The grouping plug-in that uses it, :class:`shared.algorithms.grouping.BalancedGrouping`, is one
of the Main Server's groupings (``shared/algorithms/grouping.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["label_distance", "total_distance", "num_groups_for", "group_sizes", "balanced_groups"]

# Improvements smaller than this are treated as no improvement (guards against float noise
# making the local search cycle).
_EPS = 1e-12
# Upper bound on local-search steps (each step strictly lowers the total, so it terminates
# anyway; the bound only caps worst-case running time).
_MAX_SEARCH_STEPS = 10_000


def label_distance(counts: np.ndarray) -> float:
    """Eq. 2: L2 distance of a group's pooled label distribution from uniform.

    ``counts`` is ``[members, n_classes]`` (a 1-D ``[n_classes]`` array is one member).
    Returns ``0.0`` for an empty group or a group holding no samples (documented choice).
    """
    arr = np.asarray(counts, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"counts must be [members, n_classes], got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        return 0.0
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError("label counts must be finite and non-negative")
    pooled = arr.sum(axis=0)  # sum_{c in G} |D_c^(i)| for every class i
    total = float(pooled.sum())  # sum_{p in G} |D_p|
    if total <= 0.0:
        return 0.0
    n = arr.shape[1]
    return float(math.sqrt(float(np.sum((pooled / total - 1.0 / n) ** 2))))


def _check_counts(counts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validate per-device 1-D count vectors of one common length; return float64 copies."""
    out: dict[str, np.ndarray] = {}
    n_classes: int | None = None
    for dev, c in counts.items():
        arr = np.asarray(c, dtype=np.float64).reshape(-1)
        if n_classes is None:
            n_classes = arr.shape[0]
        elif arr.shape[0] != n_classes:
            raise ValueError(
                f"device {dev!r} has {arr.shape[0]} classes, expected {n_classes}"
            )
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"device {dev!r}: label counts must be finite and non-negative")
        out[str(dev)] = arr
    return out


def _group_distance(members: Sequence[str], counts: Mapping[str, np.ndarray]) -> float:
    if not members:
        return 0.0
    # Sorted so the float sum (and hence every tie-break) is independent of list order.
    return label_distance(np.stack([counts[m] for m in sorted(members)]))


def _pooled_distance(pooled: np.ndarray) -> np.ndarray:
    """Eq. 2 from pooled class counts, vectorised over leading axes (zero total -> 0)."""
    total = pooled.sum(axis=-1, keepdims=True)
    n = pooled.shape[-1]
    safe = np.where(total > 0, total, 1.0)
    dist = np.sqrt(np.sum((pooled / safe - 1.0 / n) ** 2, axis=-1))
    return np.where(total[..., 0] > 0, dist, 0.0)


def total_distance(groups: list[list[str]], counts: dict[str, np.ndarray]) -> float:
    """Sum of Eq. 2 distances over ``groups`` (the objective :func:`balanced_groups` lowers)."""
    checked = _check_counts({m: counts[m] for g in groups for m in g})
    return float(sum(_group_distance(g, checked) for g in groups))


def num_groups_for(num_devices: int, group_size: int) -> int:
    """Number of groups ``ceil(num_devices / group_size)``, at least 1."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if num_devices < 0:
        raise ValueError(f"num_devices must be >= 0, got {num_devices}")
    return max(1, -(-num_devices // group_size))


def _sizes(num_devices: int, num_groups: int) -> tuple[int, int]:
    """(base size, how many groups hold base+1) for sizes differing by at most one."""
    return num_devices // num_groups, num_devices % num_groups


def group_sizes(num_devices: int, group_size: int) -> list[int]:
    """The sizes of the ``num_groups_for`` groups, differing by at most one, larger ones first."""
    n_groups = num_groups_for(num_devices, group_size)
    base, n_big = _sizes(num_devices, n_groups)
    return [base + (1 if g < n_big else 0) for g in range(n_groups)] if num_devices else []


def balanced_groups(counts: dict[str, np.ndarray], group_size: int) -> list[list[str]]:
    """Group devices to minimise the summed Eq. 2 distance (deterministic heuristic). One function,
    as its steps below share the groups' running label sums and distances.

    ``G = num_groups_for(len(counts), group_size)`` groups whose sizes differ by at most one.

    1. Order devices by total sample count, largest first, ties by id.
    2. Seed: the first ``G`` devices open one group each (so greedy cannot pile identical
       devices into one group just because adding a copy leaves its distance unchanged).
    3. Greedy: each remaining device joins the group with room whose distance it changes
       least (most negative delta); ties -> the lower group index.
    4. Local search: repeatedly apply the single best pairwise swap between two groups, or
       move of one device from a larger to a smaller group (keeping the size rule), while it
       lowers the total by more than 1e-12; at most 10 000 steps.

    Output: members sorted by id inside each group, groups sorted by their first member.
    Same input -> same output, independent of dict order.
    """
    checked = _check_counts(counts)
    ids = sorted(checked)
    n_dev = len(ids)
    if n_dev == 0:
        return []
    n_groups = num_groups_for(n_dev, group_size)
    base, n_big = _sizes(n_dev, n_groups)

    order = sorted(ids, key=lambda d: (-float(checked[d].sum()), d))
    groups: list[list[str]] = [[] for _ in range(n_groups)]
    dists = [0.0] * n_groups

    def has_room(g: int) -> bool:
        size = len(groups[g])
        if size < base:
            return True
        if size == base:
            return sum(1 for grp in groups if len(grp) > base) < n_big
        return False

    for idx, dev in enumerate(order):
        if idx < n_groups:
            groups[idx].append(dev)
            dists[idx] = _group_distance(groups[idx], checked)
            continue
        best_g, best_delta, best_dist = -1, math.inf, 0.0
        for g in range(n_groups):
            if not has_room(g):
                continue
            new_dist = _group_distance(groups[g] + [dev], checked)
            delta = new_dist - dists[g]
            if delta < best_delta - _EPS:
                best_g, best_delta, best_dist = g, delta, new_dist
        groups[best_g].append(dev)
        dists[best_g] = best_dist

    for grp in groups:
        grp.sort()
    for _ in range(_MAX_SEARCH_STEPS):
        best_gain = _EPS
        best_move: tuple | None = None
        mats = [np.stack([checked[m] for m in grp]) for grp in groups]  # [size, n] per group
        pooled = [mat.sum(axis=0) for mat in mats]
        for ga in range(n_groups):
            for gb in range(ga + 1, n_groups):
                old = dists[ga] + dists[gb]
                # Pairwise swaps (sizes unchanged): all (a in ga, b in gb) at once.
                diff = mats[gb][None, :, :] - mats[ga][:, None, :]  # c_b - c_a, [sa, sb, n]
                da = _pooled_distance(pooled[ga] + diff)
                db = _pooled_distance(pooled[gb] - diff)
                gain = old - (da + db)
                ia, ib = np.unravel_index(int(np.argmax(gain)), gain.shape)
                if gain[ia, ib] > best_gain:
                    best_gain = float(gain[ia, ib])
                    best_move = ("swap", ga, groups[ga][ia], gb, groups[gb][ib], float(da[ia, ib]), float(db[ia, ib]))
                # Single moves from the larger group to the smaller one (size rule kept).
                for src, dst in ((ga, gb), (gb, ga)):
                    if len(groups[src]) != len(groups[dst]) + 1:
                        continue
                    ds = _pooled_distance(pooled[src][None, :] - mats[src])
                    dd = _pooled_distance(pooled[dst][None, :] + mats[src])
                    gain_m = old - (ds + dd)
                    i = int(np.argmax(gain_m))
                    if gain_m[i] > best_gain:
                        best_gain = float(gain_m[i])
                        best_move = ("move", src, groups[src][i], dst, None, float(ds[i]), float(dd[i]))
        if best_move is None:
            break
        kind, g1, a, g2, b, d1, d2 = best_move
        groups[g1].remove(a)
        if kind == "swap":
            groups[g2].remove(b)
            groups[g1].append(b)
        groups[g2].append(a)
        # Keep members sorted so array positions (and argmax tie-breaks) depend only on ids.
        groups[g1].sort()
        groups[g2].sort()
        dists[g1], dists[g2] = d1, d2

    return sorted((sorted(g) for g in groups), key=lambda g: g[0])
