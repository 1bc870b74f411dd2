#!/usr/bin/env bash
# Installs llama-cpp-python (llama.cpp built from source for this CPU) into its own venv, for
# benchmarks/engine.py's peer column. Not a dependency of pdserve.
#   bash benchmarks/llama_cpp_venv.sh [VENV]        (default: .venv-llama-cpp)
# then: .venv/bin/python benchmarks/engine.py --llama-cpp-python VENV/bin/python
set -euo pipefail
VENV="${1:-.venv-llama-cpp}"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
# CPU build for this machine's instruction set, named flag by flag rather than GGML_NATIVE:
# a native build on a Sapphire Rapids VM compiles llama.cpp's AMX path, which dies with a
# general protection fault in its first decode there; AMX stays off, the rest follows the CPU.
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2)"
CMAKE_ARGS+=" -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f)"
CMAKE_ARGS+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS="$CMAKE_ARGS" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    llama-cpp-python==0.3.36
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
