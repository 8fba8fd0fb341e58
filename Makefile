# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
# `.ci/run` runs `make test`, then `make lint`, `make test-backends` and `make test-slow`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DCR := $(VENV)/bin/dcr
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: install demo test test-backends test-slow lint fault-matrix race bench clean

$(VENV)/.installed: pyproject.toml bench/pyproject.toml codec/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly pinned: the CPU build from the local wheel cache (see README for GPUs)
	$(PY) -m pip install -q "torch==2.13.0"
	# the dcr.sparse zarr codec: its own small package (numpy, numcodecs, zarr), a dependency of dcr
	$(PY) -m pip install -q -e ./codec
	$(PY) -m pip install -q -e ".[test]"
	# the benchmark, the demo and their models: a separate package (not in the runtime wheel)
	$(PY) -m pip install -q --no-deps -e ./bench
	$(PY) -m pip install -q "matplotlib>=3.8" "moto[server]>=5.0" boto3
	touch $@

install: $(VENV)/.installed

demo: install
	$(DCR) demo

# The default suite: unit, integration (local and memory ROOTs), system tests on the S3 server.
test: install
	$(PYTEST) -m "not slow and not backend"

# The backend matrix: every conformance and refit test against the S3 server and the GCS emulator.
test-backends: install
	$(PYTEST) -m "backend and not slow"

# Long kill sweeps, load tests and races.
test-slow: install
	$(PYTEST) -m slow

lint: install
	$(VENV)/bin/ruff check .

# Run every fault-injection and bad-input test (the slow kill -9 sweeps too) and regenerate the table.
fault-matrix: install
	$(PYTEST) -m faults --fault-matrix=docs/fault-matrix.md

# the long gc race: 300 publishes (gc after each) against 6 followers killed at random points
race: install
	DCR_RACE_STEPS=300 DCR_RACE_FOLLOWERS=6 $(PYTEST) -s tests/system/test_gc_race.py

bench: install
	$(DCR) bench --quick

clean:
	rm -rf $(VENV) dcr-demo .pytest_cache
