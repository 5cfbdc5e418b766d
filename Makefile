# Two entry points (see README): `make demo` runs the main job, `make test` runs the whole test suite.
# Each creates .venv, installs torch==2.13.0 (the on-disk CPU wheel) only if no torch is importable there,
# then installs gradsync with its dev extras.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradsync-installed

.PHONY: demo test lint lint-imports bench clean sysdeps

$(STAMP): pyproject.toml
	@echo "gradsync: first run: creating $(VENV) and installing torch and gradsync's dependencies (about 2 minutes, quiet)..."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradsync demo

# The testbed (network namespaces) needs iproute2; install it when we are root and it is missing,
# otherwise the testbed tests skip and say why.
sysdeps:
	@command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null) \
	    || echo "note: iproute2 missing and not root; testbed tests will skip"; }

# Two workers (pytest-xdist): most tests wait on processes they start (gloo ranks, servers), so two overlap on two
# cores (1.6x quicker here). The testbed's tests then run alone: they time a shaped wire, and under xdist those after
# the first class found its namespaces still up and skipped.
test: $(STAMP) sysdeps
	$(PY) -m pytest -q -n 2 --durations=15 --ignore=tests/testbed
	$(PY) -m pytest -q tests/testbed

lint: $(STAMP) lint-imports
	$(VENV)/bin/ruff check gradsync tests benchmarks

# The package layers ([tool.importlinter] in pyproject.toml): no package imports from a layer above it.
lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) -m benchmarks.plan_scaling

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
