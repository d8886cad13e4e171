"""Which split point each selected device gets (S2FL's adaptive sliding split, or a fixed one)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from fed_server.devices import DeviceRegistry
from fed_server.time_table import ClientTimeTable, SplitCostView, eq1_bytes, eq1_time
from shared.algorithms.base import SplitMode
from shared.models import ModelProfile


class SplitPlanner:
    """Maps devices to candidate indices ``j`` (into ``split_points``) and to block counts ``k``.

    ``sliding``: the client time table (warm-up, then the median rule, docs/s2fl.md); a device's
    untried candidates are scaled from its measured ones by Eq. 1's terms (:meth:`terms`), and
    devices with no measurements get Eq. 1 estimates from their profile, calibrated by the
    measured / predicted ratio of devices already in the table. ``fixed``: the largest client
    portion for everyone (SFL). ``zero``: the whole model on the device. ``pinned`` (device id ->
    split point, ``split.pinned``) overrides the choice for those devices in either split mode.

    The link rate Eq. 1 uses is measured (:meth:`observe`): after each of a device's rounds, the
    rate at which Eq. 1's bytes for that split (``2|Wc| + 2pq``) take the transfer time its table
    cell now holds (the device's timed transfers and the upload the Fed Server timed, at most the
    round's time on the Fed Server's clock, in the table's running average; a change of the link
    moves it at once, :mod:`fed_server.time_table`). A cut attempt lowers it with the device's link
    level (:meth:`censor`). Before any round, it is the rate the device registered with; a real
    device registers none (its link is not known), and until its first round its cells come from
    the other devices' entries. A measured rate is kept by device id
    (:meth:`DeviceRegistry.measure_rate`): registering again does not reset it.
    """

    def __init__(self, mode: SplitMode, split_points: Sequence[int], num_blocks: int, profile: ModelProfile,
                 table: ClientTimeTable, devices: DeviceRegistry, local_epochs: int, server_flops: float,
                 pinned: Mapping[str, int] | None = None, head_start: int | None = None) -> None:
        self.mode = mode
        self.split_points = list(split_points)
        self.num_blocks = num_blocks
        self.profile = profile
        self.table = table
        self.devices = devices
        self.local_epochs = local_epochs
        self.server_flops = server_flops
        #: U-shaped mode: where the devices' heads start (a split point of the model); None: no head.
        self.head_start = head_start
        self.pinned = dict(pinned or {})

    def _view(self, j: int) -> SplitCostView:
        """Eq. 1's inputs at candidate ``j``; U-shaped, with the head's terms, the server's FLOPs
        the middle's alone (docs/s2fl.md, "U-shaped mode")."""
        cost = self.profile.cost(self.split_points[j])
        if self.head_start is None:
            return SplitCostView(cost.client_param_bytes, cost.activation_bytes, cost.client_flops, cost.server_flops)
        head = self.profile.cost(self.head_start)
        return SplitCostView(cost.client_param_bytes, cost.activation_bytes, cost.client_flops,
                             cost.server_flops - head.server_flops, head_param_bytes=head.server_param_bytes,
                             head_activation_bytes=head.activation_bytes, head_flops=head.server_flops)

    def estimate(self, device_id: str, j: int) -> float:
        """Eq. 1 prediction of the device's round time at candidate ``j`` (uncalibrated); NaN
        while its link rate is not known."""
        record = self.devices.devices[device_id]
        rate = self.devices.link_rate(device_id)
        if rate is None:
            return math.nan
        return eq1_time(dataclasses.replace(record.profile, rate=rate), self._view(j),
                        record.num_samples * self.local_epochs, self.server_flops)

    def portion_seconds(self, device_id: str, j: int) -> float | None:
        """One-way seconds of the device's portion at candidate ``j`` on its link: ``|Wc|`` (U-shaped,
        with the head) over its measured rate, for the bottleneck cap's critical path
        (:class:`fed_server.time_table.Bottleneck`). None before its rate is measured: a rate it
        registered is its own word."""
        rate = self.devices.measured_rate(device_id)
        return self._portion_over(j, rate) if rate else None

    def _portion_over(self, j: int, rate: float) -> float:
        """Seconds the portion at candidate ``j`` takes one way at ``rate`` bytes/s."""
        return self._view(j).device_param_bytes / rate

    def download_seconds(self, chosen: Mapping[str, int | None]) -> dict[str, float | None]:
        """Seconds each chosen device (-> candidate ``j``) takes to download its client portion,
        for its own join deadline at the Main Server: ``|Wc|`` over its link rate.

        A rate the device registered is its own word: once any of the chosen devices' rates is
        measured, it counts only where it is faster than the slowest measured one, and a device
        whose rate is not measured gets that slowest one otherwise (as if its link were the
        slowest), so a claimed slow link cannot stretch its deadline. Before any is measured (a
        run's first round) the registered rates stand. None for no candidate (split depth zero)
        or while no rate among them is known. U-shaped, the portion includes the head."""
        registry = self.devices
        claimed = {d: registry.devices[d].profile.rate for d in chosen if d in registry.devices}
        measured = {d: r for d in claimed if (r := registry.measured_rate(d))}
        known = list(measured.values()) or [r for r in claimed.values() if r]
        slowest = min(known) if known else None
        out: dict[str, float | None] = {}
        for device, j in chosen.items():
            rate = measured.get(device)
            if rate is None:
                own = claimed.get(device)
                rate = slowest if own is None else max(own, slowest) if measured and slowest else own
            out[device] = None if j is None or rate is None else self._portion_over(j, rate)
        return out

    def terms(self, device_id: str, j: int) -> tuple[float, float, float]:
        """Eq. 1's terms of the device's round at candidate ``j``: the bytes on its link
        (``2|Wc| + 2pq``), its client FLOPs and the server FLOPs of its steps (NaN for a device no
        longer registered)."""
        record = self.devices.devices.get(device_id)
        if record is None:
            return math.nan, math.nan, math.nan
        view, samples = self._view(j), record.num_samples * self.local_epochs
        return eq1_bytes(view, samples), view.client_flops * samples, view.server_flops * samples

    def observe(self, device_id: str, j: int, seconds: float, transfer_s: float, compute_s: float) -> None:
        """Fold a device's round at candidate ``j`` into the time table (``seconds`` in all, of which
        ``transfer_s`` on its link and ``compute_s`` its compute; ValueError, changing nothing, for
        figures the table cannot hold), then set its link rate: Eq. 1's bytes for ``j`` over the
        transfer time its cell now holds. A device that is no longer registered, or a cell with no
        transfer time, leaves the rate as it was."""
        self.table.record(device_id, j, seconds, transfer_s, compute_s)
        parts = self.table.parts(device_id, j)
        moved = self.terms(device_id, j)[0]
        if parts is not None and parts.transfer_s > 0 and moved > 0 and math.isfinite(moved / parts.transfer_s):
            self.devices.measure_rate(device_id, moved / parts.transfer_s)

    def censor(self, device_id: str, j: int, waited_s: float) -> None:
        """The device left an attempt at candidate ``j`` unfinished after ``waited_s`` seconds (cut
        at a deadline): a censored entry of the time table (:meth:`ClientTimeTable.censor`), and its
        measured link rate falls with its link level."""
        factor = self.table.censor(device_id, j, waited_s, self.terms)
        rate = self.devices.measured_rate(device_id)
        if factor > 1.0 and rate is not None:
            self.devices.measure_rate(device_id, rate / factor)

    def choose(self, round_index: int, devices: Sequence[str]) -> dict[str, tuple[int | None, int]]:
        """device -> (candidate index or None, number of blocks on the device)."""
        if self.mode == "zero":
            return {d: (None, self.num_blocks) for d in devices}
        if self.mode == "fixed":
            chosen = {d: len(self.split_points) - 1 for d in devices}
        else:
            chosen = self.table.choose(round_index, list(devices), self.estimate, self.terms, self.portion_seconds)
        chosen.update({d: self.split_points.index(self.pinned[d]) for d in devices if d in self.pinned})
        return {d: (j, self.split_points[j]) for d, j in chosen.items()}
