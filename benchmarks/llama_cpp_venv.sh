#!/usr/bin/env bash
# Installs llama-cpp-python (llama.cpp built from source for this CPU) into its own venv, for
# benchmarks/engine.py's peer column. Not a dependency of pdserve.
#   bash benchmarks/llama_cpp_venv.sh [VENV]        (default: .venv-llama-cpp)
# then: .venv/bin/python benchmarks/engine.py --llama-cpp-python VENV/bin/python
set -euo pipefail
VENV="${1:-.venv-llama-cpp}"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
# CPU build; GGML_NATIVE tunes it for this machine, as pdserve's kernels are.
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check llama-cpp-python
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
