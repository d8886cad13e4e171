"""Datasets (embedded MNIST, CIFAR-10/100, FEMNIST) and their federated partitions.

The names below are imported from their modules on first use (PEP 562), not when the package is:
``shared.config`` needs only ``shared.data.spec`` (pydantic), and importing it must not import
torch, which ``datasets`` and ``partition`` do: the testbed launcher reads the run configuration
without torch (docs/configuration.md, ``python -m testbed``; what that saves:
benchmarks/why-the-code-is-as-it-is.md, "The launcher imports no torch").
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.data.datasets import (
        ArrayDataset, dataset_input_shape, dataset_num_classes, load_cifar, load_dataset, load_embedded_mnist,
        load_femnist, load_public_set, to_rgb32,
    )
    from shared.data.partition import (
        device_shard, partition_dataset, partition_dirichlet, partition_iid, partition_natural,
    )
    from shared.data.spec import DataSpec

#: Each exported name and the module that defines it.
_EXPORTS = {
    **dict.fromkeys(["ArrayDataset", "dataset_input_shape", "dataset_num_classes", "load_cifar", "load_dataset",
                     "load_embedded_mnist", "load_femnist", "load_public_set", "to_rgb32"], "shared.data.datasets"),
    **dict.fromkeys(["device_shard", "partition_dataset", "partition_dirichlet", "partition_iid",
                     "partition_natural"], "shared.data.partition"),
    "DataSpec": "shared.data.spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """The exported ``name``, imported from its module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shared.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
