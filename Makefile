# Two commands on a fresh machine: `make demo` and `make test`.
# torch goes in first and pinned: a bare `torch` would fetch a multi-GB CUDA build.
# Tested torch builds: 2.13.0 (default) and 2.14.1, e.g.
#   make test VENV=.venv-torch2.14 TORCH_SPEC=torch==2.14.1
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# Two installs in one venv: `make demo` installs the demo extra only; `make test` adds
# the test tools and the frameworks bl.derive supports (jax, tinygrad, mlx, paddle).
DEMO_STAMP := $(VENV)/.backlens-demo
TEST_STAMP := $(VENV)/.backlens-test
# Headless Chromium renders the HTML report in the tests: a path, or empty when
# none is found (then `make test` installs Debian's package as root, or stops).
CHROMIUM ?= $(shell command -v chromium || command -v chromium-browser)
DEBIAN_CHROMIUM := /usr/bin/chromium
# The suite runs in two processes (pytest-xdist): about 2 minutes on 2 cores instead of 3.5.
# TEST_WORKERS=0 runs it in make's own pytest process (for a debugger, say).
TEST_WORKERS ?= 2

.PHONY: demo test install lint bench clean chromium

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[demo]" "$(TORCH_SPEC)"
	touch $(DEMO_STAMP)

$(TEST_STAMP): $(DEMO_STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[test,demo,jax,tinygrad,mlx,paddle]" "$(TORCH_SPEC)"
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/backlens demo

# chromium first: a machine that cannot run the tests stops before the install.
test: chromium $(TEST_STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CHROMIUM="$(or $(CHROMIUM),$(DEBIAN_CHROMIUM))" \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

chromium:
ifeq ($(strip $(CHROMIUM)),)
ifeq ($(shell id -u),0)
	@echo "Installing Debian's chromium (headless browser for the HTML report tests)..."
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
	@test -x $(DEBIAN_CHROMIUM) || { echo "apt-get installed no $(DEBIAN_CHROMIUM)" >&2; exit 1; }
else
	$(error make test needs headless Chromium for the HTML report tests: run `sudo apt-get install -y chromium` (Debian/Ubuntu) or pass CHROMIUM=/path/to/chromium)
endif
endif

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests bench

bench: $(DEMO_STAMP)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
