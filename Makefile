# Two commands do everything on a fresh machine with Python 3.11:
#   make book   builds the HTML book into _build/html from the committed notebook outputs
#   make test   runs every check: package tests, checker tests, nbval, the book build, the browser check,
#               then nbval a second time with another CPU's numerics (scripts/other_numerics.py)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready

.PHONY: book test execute nbval clean

NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# The environment that makes this CPU compute like the other kind (AVX-512 <-> AVX2-only): the
# committed outputs must survive both, since readers' and CI's machines are of either kind.
OTHER_NUMERICS = $$($(BIN)/python scripts/other_numerics.py)

$(READY): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

book: $(READY)
	$(BIN)/jupyter-book build --warningiserror --nitpick --keep-going .

test: $(READY)
	$(BIN)/python -m pytest tests book $(NBVAL)
	env $(OTHER_NUMERICS) $(BIN)/python -m pytest book $(NBVAL)

# Authoring helpers: re-execute one notebook in place, or nbval it alone (both numerics).
execute: $(READY)
	$(BIN)/jupyter-execute --inplace $(NB)

nbval: $(READY)
	$(BIN)/python -m pytest $(NBVAL) $(NB)
	env $(OTHER_NUMERICS) $(BIN)/python -m pytest $(NBVAL) $(NB)

clean:
	rm -rf _build
