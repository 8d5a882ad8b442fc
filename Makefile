# Two commands on a fresh machine: `make run` and `make test` (see README.md and
# docs/get-started/install.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP  := $(VENV)/.installed
## pip byte-compiles what it installs on one core (a minute for torch and the extras), most of
## which nothing imports: Python compiles a module the first time a process imports it
## (`make test` imports 7,000 of the venv's 15,800 files). Where the environment forbids writing
## bytecode (PYTHONDONTWRITEBYTECODE), every process would compile what it imports again, so the
## venv is compiled once after the install, on every core (`-j 0`), its packages' own test
## folders aside. As with pip, a file this Python cannot compile is left alone: hence `|| true`.
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile
COMPILE := [ -z "$$PYTHONDONTWRITEBYTECODE" ] || $(BIN)/python -m compileall -qq -j 0 -x '/tests?/' $(VENV)/lib || true

.PHONY: run test test-fast test-images quality lint types docs venv bench clean

## What the main job needs (torch, then vip-hub with every runtime extra); `venv` installs the
## test tools and the site's builder with them in one pass (its stamp stands for both), which
## `make run` does not wait for (about 25 s of the install).
TORCH := torch==2.14.1 torchvision==0.29.1
$(RUNTIME): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH) -e '.[all]'
	@$(COMPILE)
	@touch $(RUNTIME)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH) -e '.[all,dev,docs]'
	@$(COMPILE)
	@touch $(RUNTIME) $(STAMP)

venv: $(STAMP)

## The main job: train, publish and serve private encoders (docs/get-started/main-job.md).
run: $(RUNTIME)
	$(BIN)/vip-hub run

## Two pytest workers by default (pytest-xdist, one per core; what CI runs): each worker has its
## own servers, ports, folders and share of the cores, and a file's tests stay on one worker
## (loadfile), so its module-scoped fixtures (servers, trained repos) are built once, not once per
## worker. Files are handed out in collection order, the slow ones first (tests/conftest.py), not
## by their test counts, which put the long end-to-end files last. `make test XDIST=` runs them in
## one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder

## Lint, format and layer contracts first (seconds: a mistake there stops it at once), then every
## test, the slow end-to-end ones included, but for the images (`make test-images`, which CI runs
## next), with mypy running beside them (the tests leave a core idle part of the time): its output
## comes after the tests', and either failing fails the target. The strict build of the
## documentation site is one of the tests (tests/project/test_docs_site.py builds it, then opens
## every page in a browser), so it is not built twice.
TYPES_LOG := $(VENV)/.types.log
test: lint
	@$(TYPES) > $(TYPES_LOG) 2>&1 & checks=$$!; \
	$(BIN)/python -m pytest $(XDIST) -m "not images"; tests=$$?; \
	wait $$checks; checked=$$?; cat $(TYPES_LOG); \
	[ $$checked -eq 0 ] || echo "make test: mypy failed (above)"; \
	[ $$tests -eq 0 ] && [ $$checked -eq 0 ]

## The Docker images and compose files, built and brought up (tests/project/test_images.py, one
## process: the builds take the cores): starts dockerd if none runs and installs docker.io,
## docker-compose and debootstrap when missing (root). 6-10 minutes from scratch, 5 with the images cached (see
## docs/deploy.md); CI runs it after `test`.
test-images: venv
	$(BIN)/python -m pytest -m images tests/project/test_images.py

## Lint (ruff check), formatting (ruff format --check), the layer contracts (lint-imports) and the
## types of vip_hub, training, service and benchmarks (mypy, [tool.mypy] in pyproject.toml; its cache in
## .mypy_cache/ makes a re-run take seconds).
quality: lint types

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

TYPES := $(BIN)/mypy
types: venv
	$(TYPES)

## The documentation site (mkdocs.yml, docs/), built strictly into build/site/: any warning fails
## (a dead link or anchor, a page missing from the nav, a docstring griffe cannot parse).
DOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
docs: venv
	$(DOCS)

## Skip the slow end-to-end tests.
test-fast: venv
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

## Speed ratios (never fail on speed): the speed benchmarks, side by side (own_process.py is their
## helper); the other scripts are studies with their own arguments (benchmarks/README.md).
SPEED := clip_margins dp_step hub logit_dp noise objstore replicas serve
bench: venv
	@for b in $(SPEED); do echo "== benchmarks/$$b.py"; $(BIN)/python benchmarks/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
