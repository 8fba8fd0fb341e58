# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DCR := $(VENV)/bin/dcr

.PHONY: install demo test fault-matrix clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly pinned: the CPU build from the local wheel cache (see README for GPUs)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(DCR) demo

test: install
	$(PY) -m pytest -q -m "not slow"

# Run every fault-injection and bad-input test (the slow kill -9 sweeps too) and regenerate the table.
fault-matrix: install
	$(PY) -m pytest -q -m faults -p no:cacheprovider --fault-matrix=docs/fault-matrix.md

clean:
	rm -rf $(VENV) dcr-demo .pytest_cache
