# Two entry points for a new user: `make demo` and `make test`. Both build the venv on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv demo test bench clean

venv: $(VENV)/.installed

# torch first, pinned to the CPU wheel, so the package's `torch>=2.3` is already satisfied.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: venv
	$(VENV)/bin/xcluster demo

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
