"""The edge install takes a CPU-only torch on every architecture.

PyPI's Linux aarch64 torch wheel is a CUDA 13 build from 2.11.0 on: the 2.13.0 wheel is 407 MiB
and pulls the nvidia-* packages (a 4.7 GB environment, too much for a 1-2 GB board), while
2.10.0's is 139 MiB and has no CUDA dependency (PyPI's file list; installed and checked under qemu
by deploy/edge/arm64_check.sh, docs/deployment.md). These checks are static: they read
pyproject.toml and the Dockerfiles, and fail if aarch64 would get a release with CUDA.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# The first release whose PyPI wheel for Linux aarch64 carries CUDA.
FIRST_CUDA_AARCH64_ON_PYPI = Version("2.11.0")
# platform_machine as each OS reports it: Linux x86_64 and aarch64, macOS arm64, Windows AMD64.
MACHINES = {"x86_64": "Linux", "aarch64": "Linux", "arm64": "Darwin", "AMD64": "Windows"}


def torch_pin(machine: str) -> Version:
    """The exact torch version `pip install .` requires on ``machine``; fails unless exactly one
    torch requirement applies there and it pins one version."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = {"platform_machine": machine, "platform_system": MACHINES[machine],
           "sys_platform": {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[MACHINES[machine]]}
    torch = [r for r in map(Requirement, dependencies)
             if r.name == "torch" and (r.marker is None or r.marker.evaluate(env))]
    assert len(torch) == 1, f"{machine}: {len(torch)} torch requirements apply"
    (spec,) = torch[0].specifier
    assert spec.operator == "==", f"{machine}: torch must be pinned, got {spec}"
    return Version(spec.version)


def dockerfile_torch(dockerfile: str, arch: str) -> str:
    """The command docker/``dockerfile`` installs torch with for TARGETARCH ``arch`` (amd64 or
    another), its ARG defaults substituted."""
    text = (ROOT / "docker" / dockerfile).read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    block = re.search(r'^RUN if \[ "\$\{TARGETARCH:-amd64\}" = "amd64" \]; then(.*?)\bfi\b', text, re.M | re.S)
    assert block, "the torch install branches on TARGETARCH"
    amd64, other = block.group(1).split("else")
    branch = amd64 if arch == "amd64" else other
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], " ".join(branch.split()))


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_every_machine_gets_one_pinned_torch(machine):
    assert torch_pin(machine) >= Version("2.0")


def test_aarch64_pin_is_a_release_whose_pypi_wheel_has_no_cuda():
    assert torch_pin("aarch64") < FIRST_CUDA_AARCH64_ON_PYPI


@pytest.mark.parametrize("dockerfile", ["device.Dockerfile", "server.Dockerfile"])
def test_image_arm64_installs_the_aarch64_pin_from_pypi(dockerfile):
    command = dockerfile_torch(dockerfile, "arm64")
    assert f'torch=={torch_pin("aarch64")}"' in command, command
    # PyPI only: a CUDA index (download.pytorch.org/whl/cu*) or any other index is not allowed here.
    assert "--index-url" not in command and "--extra-index-url" not in command, command

