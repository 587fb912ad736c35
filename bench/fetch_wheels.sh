#!/bin/sh
# Wheels that bench/gpu_check.py installs on a lent GPU machine, whose own python3 (3.12, CUDA
# torch) lacks them.  Run here, from the repository root; bench/wheels/ is git-ignored and travels
# with the device tool's `carry` (see docs/gpu-check.md).
#   cupti-python 13.0.x: the newest release for a CUDA 13.0 driver stack (13.1+ expects a newer CUPTI).
set -e
PY=${PYTHON:-.venv/bin/python}
rm -rf bench/wheels && mkdir -p bench/wheels
$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d bench/wheels apache-tvm-ffi cupti-python==13.0.1 pyelftools
ls -l bench/wheels
