"""Datasets (embedded MNIST, CIFAR-10/100, FEMNIST) and their federated partitions."""
from shared.data.datasets import (
    ArrayDataset,
    dataset_input_shape,
    dataset_num_classes,
    load_cifar,
    load_dataset,
    load_embedded_mnist,
    load_femnist,
    load_public_set,
    to_rgb32,
)
from shared.data.partition import (
    device_shard,
    partition_dataset,
    partition_dirichlet,
    partition_iid,
    partition_natural,
)
from shared.data.spec import DataSpec

__all__ = [
    "ArrayDataset",
    "DataSpec",
    "dataset_input_shape",
    "dataset_num_classes",
    "device_shard",
    "load_cifar",
    "load_dataset",
    "load_embedded_mnist",
    "load_femnist",
    "load_public_set",
    "partition_dataset",
    "partition_dirichlet",
    "partition_iid",
    "partition_natural",
    "to_rgb32",
]
