# `make demo` and `make test` work from a fresh clone: they create .venv (unless a virtual
# environment is already active), install torch 2.13.0 when no torch is importable (pinned: the
# project's CI machines hold that CPU build locally, where an unpinned torch would pull a
# multi-GB CUDA build; elsewhere pip resolves the pin from its index, so install the torch build
# you want first), then the package itself in editable mode.

ifdef VIRTUAL_ENV
PY := $(VIRTUAL_ENV)/bin/python
ENV_STAMP := $(VIRTUAL_ENV)/.flatopt-installed
else
PY := .venv/bin/python
ENV_STAMP := .venv/.flatopt-installed
endif
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test env lint clean

env: $(ENV_STAMP)

# pip runs quietly (-q): each step says first what it installs, since torch and triton take minutes.
$(ENV_STAMP): pyproject.toml
	@test -x $(PY) || { echo "Creating .venv (the virtual environment make uses here)"; python3 -m venv .venv; }
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "Installing torch 2.13.0, as no torch is importable (install the build you want first to choose it) ..."; \
		$(PIP) install torch==2.13.0; }
	@echo "Installing flatopt in editable mode with its dependencies: triton, numpy, and the test, demo and integration extras" \
		"(pytest, matplotlib, transformers, accelerate, lightning) ..."
	$(PIP) install -e ".[test,demo,integrations]"
	@echo "Environment ready: $(PY)"
	@touch $@

demo: env
	$(dir $(PY))flatopt demo

# The Triton kernels also run on the CPU, under the Triton interpreter.
test: env
	TRITON_INTERPRET=1 $(PY) -m pytest -q

lint: env
	$(PIP) install ruff && $(PY) -m ruff check . && $(PY) -m ruff format --check .

clean:
	rm -rf .venv build *.egg-info .pytest_cache
