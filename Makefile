# Two commands do all the set-up on a fresh machine with Python 3.11+:
#   make demo   the main job: a guided run against a local receiver on embedded SQLite
#   make test   lint, type-check and the test suite (SQLite and PostgreSQL); make soak: the soaks
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test unit docs lint bench soak clean

$(BIN)/outbox: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

install: $(BIN)/outbox

demo: install
	$(BIN)/outbox demo --dir demo-files

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# The manual, built as CI builds it: any warning (a broken link, a missing page) fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet --site-dir build/site

# The unit tier alone (no process spawned, no server: about 15 s).
unit: install
	$(BIN)/python -m pytest tests/unit -m "not soak" $(PYTEST_ARGS)

# The everyday tier: unit, integration, acceptance, faults, security (a few minutes).
test: lint docs
	$(BIN)/python -m pytest -m "not soak" $(PYTEST_ARGS)

# The randomized fault soaks and the planted-bug runs (several minutes more). A run
# prints its seed; OUTBOX_SOAK_SEED=N replays it.
soak: install
	$(BIN)/python -m pytest -m soak $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python -m benchmarks run

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache
