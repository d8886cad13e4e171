"""Which split point each selected device gets (S2FL's adaptive sliding split, or a fixed one)."""
from __future__ import annotations

from collections.abc import Sequence

from fed_server.devices import DeviceRegistry
from fed_server.time_table import ClientTimeTable, SplitCostView, eq1_time
from shared.algorithms.base import SplitMode
from shared.models import ModelProfile


class SplitPlanner:
    """Maps devices to candidate indices ``j`` (into ``split_points``) and to block counts ``k``.

    ``sliding``: the client time table (warm-up, then the median rule); devices with no
    measurements get Eq. 1 estimates from their reported profile, calibrated by the measured /
    predicted ratio of devices already in the table. ``fixed``: the largest client portion for
    everyone (SFL). ``zero``: the whole model on the device.
    """

    def __init__(self, mode: SplitMode, split_points: Sequence[int], num_blocks: int, profile: ModelProfile,
                 table: ClientTimeTable, devices: DeviceRegistry, local_epochs: int, server_flops: float) -> None:
        self.mode = mode
        self.split_points = list(split_points)
        self.num_blocks = num_blocks
        self.profile = profile
        self.table = table
        self.devices = devices
        self.local_epochs = local_epochs
        self.server_flops = server_flops

    def estimate(self, device_id: str, j: int) -> float:
        """Eq. 1 prediction of the device's round time at candidate ``j`` (uncalibrated)."""
        record = self.devices.devices[device_id]
        cost = self.profile.cost(self.split_points[j])
        view = SplitCostView(cost.client_param_bytes, cost.activation_bytes, cost.client_flops, cost.server_flops)
        return eq1_time(record.profile, view, record.num_samples * self.local_epochs, self.server_flops)

    def choose(self, round_index: int, devices: Sequence[str]) -> dict[str, tuple[int | None, int]]:
        """device -> (candidate index or None, number of blocks on the device)."""
        if self.mode == "zero":
            return {d: (None, self.num_blocks) for d in devices}
        if self.mode == "fixed":
            j = len(self.split_points) - 1
            return {d: (j, self.split_points[j]) for d in devices}
        chosen = self.table.choose(round_index, list(devices), self.estimate)
        return {d: (j, self.split_points[j]) for d, j in chosen.items()}
