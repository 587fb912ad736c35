"""The GPU check's dry run (docs/gpu-check.md): the command a lent GPU machine gets, run here
on a machine made to look like that one, so that every step before the first CUDA call is
proven before device time is spent.

The simulated machine: a `python3` with torch and numpy preinstalled but neither tvm-ffi nor
cupti-python (a virtual environment, built once and kept under ~/.cache), no `bwrap` and no
`ninja` on PATH, no network (its own network namespace where `unshare` allows, else pip told to use no index),
pip's own configuration dropped, and the packages it lacks only from bench/wheels/.  The
command is taken verbatim from docs/gpu-check.md; KCORAL_GPU_CHECK_DRY_RUN=1 makes its servers
CPU ones and SKIPs each step that needs CUDA.  Fetching the wheels (bench/fetch_wheels.sh)
and building the environment may use the network; the dry run itself does not.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT

WHEELS = os.path.join(ROOT, "bench", "wheels")
DEBS = ("bubblewrap.deb", "libcap2.deb", "libselinux1.deb", "libpcre2-8-0.deb")
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
MAX_FILES_BACK = 8  # what a lent device machine brings back from $OUT


def documented_command():
    """The first `run(command="...")` of docs/gpu-check.md: the full run on a lent machine."""
    with open(os.path.join(ROOT, "docs", "gpu-check.md"), encoding="utf-8") as f:
        return re.search(r'run\(command="([^"]+)"', f.read()).group(1)


def carried_wheels():
    """bench/wheels with a wheel of each distribution for this Python, fetched if missing -> its path."""
    wanted = [f"apache_tvm_ffi-*-{PYTHON_TAG}-*.whl", f"cupti_python-*-{PYTHON_TAG}-*.whl", "pytest-*.whl",
              "ninja-*.whl", *DEBS]
    if not all(glob.glob(os.path.join(WHEELS, pattern)) for pattern in wanted):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        fetched = subprocess.run(["sh", "bench/fetch_wheels.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                                 env={**os.environ, "PYTHON": sys.executable, "PYTHON_VERSIONS": f"3.12 {version}"})
        if fetched.returncode != 0:
            pytest.skip(f"bench/fetch_wheels.sh could not fetch the carried packages: {fetched.stderr[-300:]}")
    return WHEELS


def machine_python():
    """A virtual environment standing in for the device's interpreter: torch and numpy (as this
    one has them), no tvm-ffi, no cupti-python -> its bin folder.  Built once per versions."""
    import numpy
    import torch
    key = f"{PYTHON_TAG}-torch{torch.__version__}-numpy{numpy.__version__}"
    home = os.path.join(os.path.expanduser("~"), ".cache", "kcoral-gpu-dry-run", key)
    python = os.path.join(home, "bin", "python")
    if not os.path.exists(os.path.join(home, "ready")):
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", home], check=True, timeout=300)  # with pip, as the device
        built = subprocess.run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__}",
                                f"numpy=={numpy.__version__}"], capture_output=True, text=True, timeout=900)
        if built.returncode != 0:
            pytest.skip(f"could not install torch and numpy for the simulated machine: {built.stderr[-300:]}")
        open(os.path.join(home, "ready"), "w").close()
    lacking = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('tvm_ffi'), "
                              "u.find_spec('cupti'))"], capture_output=True, text=True, timeout=60)
    assert lacking.stdout.split() == ["None", "None"], lacking
    return os.path.dirname(python)


ABSENT_PROGRAMS = ("bwrap", "ninja")  # what the device may lack and the check brings (the .deb, a wheel)


def path_without_bwrap(folder):
    """A PATH folder of links to every program on this PATH but `bwrap` and `ninja` (and this
    project's virtual environment, whose python3 has tvm-ffi) -> its path."""
    os.makedirs(folder)
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory) or os.path.abspath(directory) == venv_bin:
            continue
        for name in os.listdir(directory):
            target, link = os.path.join(directory, name), os.path.join(folder, name)
            if name not in ABSENT_PROGRAMS and os.access(target, os.X_OK) and not os.path.lexists(link):
                os.symlink(target, link)
    return folder


def offline_prefix():
    """A network namespace with only loopback up (the servers listen there), where this user may
    make one: the dry run then reaches nothing else.  [] where it may not."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    prefix = [unshare, "--net", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh"]
    if unshare and ip and subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
        return prefix
    return []


def test_the_documented_gpu_run_goes_green_as_a_dry_run_on_cpu(tmp_path):
    carried_wheels()
    machine_bin = machine_python()
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()  # its own temporary folder: the carried packages are installed under it
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "CUDA_")) and name != "KCORAL_URL"}
    env.update(PATH=machine_bin + os.pathsep + path_without_bwrap(str(tmp_path / "bin")), OUT=str(out),
               TMPDIR=str(tmp), KCORAL_GPU_CHECK_DRY_RUN="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
               http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")  # no index, no way out
    assert not any(shutil.which(name, path=env["PATH"]) for name in ABSENT_PROGRAMS)
    assert shutil.which("python3", path=env["PATH"]) == os.path.join(machine_bin, "python3")
    command = documented_command()
    done = subprocess.run([*offline_prefix(), "bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=420)  # the device call's own limit (timeout_s)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "DRY RUN" in log and re.search(r"^\d+ passed, 0 failed, \d+ skipped$", log, re.M), log[-3000:]
    assert (out / "gpu_check.log").read_text() == done.stdout  # tee'd as on the device
    assert len(os.listdir(out)) <= MAX_FILES_BACK and {"gpu_check.json", "gpu_check.log", "servers.log"} <= set(
        os.listdir(out)), os.listdir(out)
    report = json.loads((out / "gpu_check.json").read_text())
    phases = report["phases"]
    assert report["device"] == "gpu" and report["dry_run"] is True
    preflight = phases["preflight"]
    assert preflight["result"] == "SKIP" and "before its first CUDA call" in preflight["detail"]
    versions = preflight["data"]["versions"]  # what the carried wheels installed, nothing else
    assert versions["apache-tvm-ffi"] and versions["cupti-python"] and versions["torch"], versions
    assert preflight["data"]["tools"]["bwrap"] is None
    assert phases["main_server"]["cases"]["library"]["result"] == "PASS"  # built with the carried ninja
    for name in ("cpu_mode",):
        assert phases[name]["result"] == "SKIP" and "dry run: needs a CUDA device" in phases[name]["detail"]
    assert phases["examples"]["result"] == "SKIP" and "need a GPU" in phases["examples"]["detail"]
    for name in ("request_overhead", "main_server", "cli_tools"):
        assert phases[name]["result"] == "PASS", phases[name]
    sandboxed = phases["sandboxed"]  # the carried bwrap, unpacked; its template imports tvm_ffi from the wheels
    if sandboxed["result"] == "SKIP":
        assert "cannot create a container here" in sandboxed["detail"], sandboxed
    else:
        assert sandboxed["result"] == "PASS" and "kcoral-bwrap-" in sandboxed["data"]["bwrap"], sandboxed
