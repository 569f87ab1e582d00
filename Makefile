# Two commands do everything on a fresh machine with Python 3.11:
#   make book   builds the HTML book into _build/html from the committed notebook outputs
#   make test   runs every check: package tests, checker tests, nbval, the book build, the browser check
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready

.PHONY: book test execute nbval clean

$(READY): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

book: $(READY)
	$(BIN)/jupyter-book build --warningiserror --nitpick --keep-going .

test: $(READY)
	$(BIN)/python -m pytest tests book --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

# Authoring helpers: re-execute one notebook in place, or nbval it alone.
execute: $(READY)
	$(BIN)/jupyter-execute --inplace $(NB)

nbval: $(READY)
	$(BIN)/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg $(NB)

clean:
	rm -rf _build
