# Two commands on a fresh machine: `make run` and `make test` (see README.md and
# docs/get-started/install.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: run test test-fast test-images quality docs venv bench clean

## What the main job needs (torch, then vip-hub with every runtime extra); `venv` installs the
## test tools and the site's builder with them in one pass (its stamp stands for both), which
## `make run` does not wait for (about 25 s of the install).
TORCH := torch==2.14.1 torchvision==0.29.1
$(RUNTIME): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e '.[all]'
	@touch $(RUNTIME)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e '.[all,dev,docs]'
	@touch $(RUNTIME) $(STAMP)

venv: $(STAMP)

## The main job: train, publish and serve private encoders (docs/get-started/main-job.md).
run: $(RUNTIME)
	$(BIN)/vip-hub run

## Two pytest workers by default (pytest-xdist, one per core; what CI runs): each worker has its
## own servers, ports, folders and share of the cores, and a module's tests stay on one worker
## (loadgroup). `make test XDIST=` runs them in one process.
XDIST ?= -n 2 --dist loadgroup

## Lint, format, layer contracts and types (ruff, import-linter, mypy), the documentation site
## built strictly, then every test, the slow end-to-end ones included, but for the images
## (`make test-images`, which CI runs next).
test: quality docs
	$(BIN)/python -m pytest $(XDIST) -m "not images"

## The Docker images and compose files, built and brought up (tests/project/test_images.py, one
## process: the builds take the cores): starts dockerd if none runs and installs docker.io,
## docker-compose and debootstrap when missing (root). 6-10 minutes from scratch, 5 with the images cached (see
## docs/deploy.md); CI runs it after `test`.
test-images: venv
	$(BIN)/python -m pytest -m images tests/project/test_images.py

## Lint (ruff check), formatting (ruff format --check), the layer contracts (lint-imports) and the
## types of vip_hub, training and service (mypy, [tool.mypy] in pyproject.toml; its cache in
## .mypy_cache/ makes a re-run take seconds).
quality: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

## The documentation site (mkdocs.yml, docs/), built strictly into build/site/: any warning fails
## (a dead link or anchor, a page missing from the nav, a docstring griffe cannot parse).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

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
