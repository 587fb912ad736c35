#!/bin/sh
# What bench/gpu_check.py installs or unpacks on a lent GPU machine, whose own python3 (3.12,
# CUDA torch) lacks it and which reaches no network.  Run here, from the repository root, on a
# Debian/Ubuntu host with apt; bench/wheels/ is git-ignored and travels with the device tool's
# `carry` (see docs/gpu-check.md).
#   apache-tvm-ffi: the version our own environment runs, so the device tests what we test here.
#   cupti-python 13.0.x: the newest release for a CUDA 13.0 driver stack (13.1+ expects a newer CUPTI).
#   bubblewrap and the libraries its bwrap links (libcap2, libselinux1, libpcre2-8-0): the device
#   has no bwrap; gpu_check unpacks these with `dpkg -x` and uses the libraries only when the
#   device lacks them.  Saved as <package>.deb (the epoch in apt's names is an odd `%3a`).
#   pytest and what it needs: gpu_check imports the tests' helpers (tests/support.py), which import it.
#   ninja: tvm_ffi.cpp.build runs it, and the device may have none (its binary lands in the site's bin/).
#   PYTHON_VERSIONS: the CPythons to fetch wheels for (the device's 3.12; the CPU dry run adds its own).
set -e
PY=${PYTHON:-.venv/bin/python}
TVM_FFI=0.1.15.post2
rm -rf bench/wheels && mkdir -p bench/wheels
for version in ${PYTHON_VERSIONS:-3.12}; do
    $PY -m pip download --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d bench/wheels apache-tvm-ffi==$TVM_FFI cupti-python==13.0.1
done
$PY -m pip download --only-binary=:all: --python-version 3.12 -d bench/wheels pytest==9.2.0 ninja==1.13.2  # any 3.x
for package in bubblewrap libcap2 libselinux1 libpcre2-8-0; do
    (cd bench/wheels && apt-get download "$package" && mv "$package"_*.deb "$package.deb")
done
ls -l bench/wheels
