PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/specdec demo

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_runner.py

clean:
	rm -rf $(VENV) build *.egg-info
