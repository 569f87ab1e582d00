# Two commands do everything on a fresh machine with Python 3.11:
#   make book   builds the HTML book into _build/html from the committed notebook outputs
#   make test   runs every check: package tests, checker tests, nbval, the book build, the browser check,
#               then nbval a second time with another CPU's numerics (scripts/other_numerics.py)
# CI also runs `make test-minimum`: in a venv of its own, at the lowest numpy, matplotlib and `minilm`
# extra that pyproject.toml declares (scripts/minimum_requirements.py), the package tests, nbval of three
# numpy chapters, and every other chapter checked for errors.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready

.PHONY: book pdf test test-minimum execute nbval clean system format

NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# The environment that makes this CPU compute with other kernels (torch's AVX2 ones on AVX-512, its default
# ones elsewhere; MKL's compatibility path; another OpenBLAS family): the
# committed outputs must survive both, since readers' and CI's machines are of either kind.
OTHER_NUMERICS = $$($(BIN)/python scripts/other_numerics.py)

$(READY): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# Debian's chromium (the page and browser checks) and TeX (the PDF): installed when missing and this
# user may (root, or sudo without a password); otherwise the command to run is printed and make stops
# here, before anything else runs.
system:
	bash scripts/system_packages.sh

# ruff formats the code at the book's line length (pyproject.toml), then scripts/fit_lines.py
# rewraps what the formatter leaves long: docstrings, comments, string literals. tests/test_style.py
# checks the result.
format: $(READY)
	$(BIN)/python scripts/fit_lines.py conftest.py code tests scripts book
	$(BIN)/ruff check --fix --quiet conftest.py code tests scripts book

book: $(READY)
	$(BIN)/jupyter-book build --warningiserror --nitpick --keep-going .

# The book as one PDF, _build/latex/attention-derived.pdf (xelatex; it needs Debian's TeX packages,
# the apt-get line in .ci/run). The old PDF is removed first, so that a failed run leaves none behind.
pdf: system $(READY)
	rm -f _build/latex/attention-derived.pdf
	$(BIN)/jupyter-book build --builder pdflatex --warningiserror --nitpick --keep-going .
	test -s _build/latex/attention-derived.pdf

# Tests and notebooks run two files at a time (pytest-xdist), each file whole on one worker (--dist
# loadfile): a notebook's cells share one kernel, in order, and a test file's fixtures (a book build, a
# browser) serve all its tests. No checked output depends on time, so the load that two files put on
# each other changes only the timings, which are never checked. Each worker, and each notebook kernel
# it starts, computes on one thread (OMP_NUM_THREADS, which torch, MKL and OpenBLAS read): two files on
# two cores with two threads each leave every thread pool spin-waiting for a thread that is not running
# (chapter 2 took 34 s that way instead of 5.5 s). The committed outputs were computed with torch's default
# thread count, so this checks them under another thread count as well. The slowest files go first
# (conftest.py, SLOWEST_FIRST), so that none of them is left running alone at the end.
PARALLEL := -n 2 --dist loadfile
test test-minimum: export OMP_NUM_THREADS := 1

test: system $(READY)
	$(BIN)/python -m pytest $(PARALLEL) tests
	$(BIN)/python -m pytest $(PARALLEL) book $(NBVAL)
	env $(OTHER_NUMERICS) $(BIN)/python -m pytest $(PARALLEL) book $(NBVAL)

MIN_VENV := .venv-minimum
# Tests that need what only the full environment has (jupyter-book, myst-nb, a browser, sentence-transformers,
# TeX for the PDF, the JupyterLite build, ruff).
FULL_ONLY := tests/test_book.py tests/test_notebooks.py tests/test_colab_setup.py tests/test_glue.py tests/test_minilm.py \
             tests/test_pdf.py tests/test_lite.py tests/test_style.py
# Chapters whose outputs are compared there (numpy and matplotlib only, no training); every other
# chapter runs there too, checked for errors only (--nbval-lax): its printed reprs may differ by version.
MIN_CHAPTERS := book/02-queries-keys-values.ipynb book/04-softmax.ipynb book/09-flash-attention.ipynb
# Chapter 13 builds DeepSeek-V3's attention and reads Gemma 3n's and Gemma 4's configurations, which
# transformers has from version 5 on; the minimum environment's 4.38 cannot run it. Chapter 14 builds
# gpt-oss's attention and DeepSeek-V3.2's indexer, also new in transformers 5; chapter 15 runs
# transformers' continuous batching (generate_batch), also new in transformers 5; chapter 16 (the
# delta rule) runs Qwen3-Next's and Kimi Linear's delta-rule code.
MIN_NEEDS_NEWER := book/12-latent-attention.ipynb book/13-sparse-attention.ipynb \
	book/14-serving.ipynb book/15-delta-rule.ipynb
MIN_LAX := $(filter-out $(MIN_CHAPTERS) $(MIN_NEEDS_NEWER),$(wildcard book/[0-9]*.ipynb))

$(MIN_VENV)/.ready: requirements.txt pyproject.toml scripts/minimum_requirements.py
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MIN_VENV)/bin/python scripts/minimum_requirements.py > $(MIN_VENV)/requirements.txt
	$(MIN_VENV)/bin/python scripts/minimum_requirements.py --no-deps > $(MIN_VENV)/requirements-no-deps.txt
	$(MIN_VENV)/bin/python -m pip install --quiet -r $(MIN_VENV)/requirements.txt
	$(MIN_VENV)/bin/python -m pip install --quiet --no-deps -r $(MIN_VENV)/requirements-no-deps.txt
	$(MIN_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test-minimum: $(MIN_VENV)/.ready
	$(MIN_VENV)/bin/python -m pip freeze | grep -i -E '^(numpy|matplotlib|torch|safetensors|tokenizers|huggingface.hub|transformers)=='
	$(MIN_VENV)/bin/python -m pytest $(PARALLEL) tests $(addprefix --ignore=,$(FULL_ONLY))
	$(MIN_VENV)/bin/python -m pytest $(PARALLEL) $(NBVAL) $(MIN_CHAPTERS)
	$(MIN_VENV)/bin/python -m pytest $(PARALLEL) --nbval-lax --nbval-current-env $(MIN_LAX)

# Authoring helpers: re-execute one notebook in place, or nbval it alone (both numerics).
execute: $(READY)
	$(BIN)/jupyter-execute --inplace $(NB)

nbval: $(READY)
	$(BIN)/python -m pytest $(NBVAL) $(NB)
	env $(OTHER_NUMERICS) $(BIN)/python -m pytest $(NBVAL) $(NB)

clean:
	rm -rf _build $(MIN_VENV)
