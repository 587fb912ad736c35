"""`kcoral run` end to end on a real server, for the GPU check script.

    from bench.cli_checks import cli_tool_checks
    for name, ok, detail in cli_tool_checks(server.url, scratch_dir):
        ...

Each check is one `python -m kcoral run ...` process, as a user would type it. `ncu` and
`compute-sanitizer` are profiled once each on a small torch CUDA workload when they are on
this machine's PATH (the server runs here, so its workers see the same PATH); when one is
absent, the check instead verifies the one-line "not installed" answer (exit 1).

    .venv/bin/python -m bench.cli_checks http://127.0.0.1:8000     # against a running server
"""

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKLOAD = """\
import torch
x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
print("sum", float((x * 2).sum()))
"""


def cli_tool_checks(url: str, out_dir: str, timeout: float = 300) -> list[tuple[str, bool, str]]:
    """[(name, ok, detail)] for `kcoral run python`, `ncu` and `compute-sanitizer` against
    ``url``; ``out_dir`` (an existing directory) receives the workload and the ncu report.
    Each command runs at most ``timeout`` seconds on the server (a longer one is a failed check)."""
    with open(os.path.join(out_dir, "workload.py"), "w") as f:
        f.write(WORKLOAD)
    checks = [_check_python(url, out_dir, timeout)]
    for tool, check in (("ncu", _check_ncu), ("compute-sanitizer", _check_sanitizer)):
        checks.append(check(url, out_dir, timeout) if shutil.which(tool) else _check_absent(url, out_dir, tool, timeout))
    return checks


def _kcoral_run(out_dir: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`kcoral run TOOL --timeout T ...`: the server ends the tool after T s; our own wait allows
    for the answer's way back, and a command still running after that reads as exit 124."""
    tool, *rest = args
    env = {**os.environ, "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "kcoral", "run", tool, "--timeout", str(timeout), *rest]
    try:
        return subprocess.run(command, cwd=out_dir, env=env, check=False, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", f"no answer within {timeout + 30} s")


def _tail(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}: {(result.stdout + result.stderr).strip()[-300:]}"


def _check_python(url: str, out_dir: str, timeout: float) -> tuple[str, bool, str]:
    result = _kcoral_run(out_dir, "python", "--url", url, "--", "-c", "import sys; print('argv', sys.argv[1:])", "a",
                         timeout=timeout)
    return "kcoral run python", result.returncode == 0 and result.stdout == "argv ['a']\n", _tail(result)


# one kernel, one metric, clocks as they are: ncu's defaults (a full section set, locked clocks,
# every kernel) take minutes on a torch program
NCU_OPTIONS = ("--clock-control", "none", "--launch-count", "1", "--metrics", "gpu__time_duration.sum")


def _check_ncu(url: str, out_dir: str, timeout: float) -> tuple[str, bool, str]:
    report_dir = os.path.join(out_dir, "ncu-report")
    result = _kcoral_run(out_dir, "ncu", "--url", url, "--send", "workload.py", "--out", report_dir,
                         "--", *NCU_OPTIONS, "--", sys.executable, "workload.py", timeout=timeout)
    report = os.path.join(report_dir, "capture.ncu-rep")
    size = os.path.getsize(report) if os.path.isfile(report) else 0
    return "kcoral run ncu", result.returncode == 0 and size > 0, f"report {size} bytes; {_tail(result)}"


# memcheck for memory errors only: by default it also reports, as errors, the CUDA API calls that
# fail by design (torch probes the driver so), and those say nothing of the workload
SANITIZER_OPTIONS = ("--tool", "memcheck", "--report-api-errors", "no")


def _check_sanitizer(url: str, out_dir: str, timeout: float) -> tuple[str, bool, str]:
    result = _kcoral_run(out_dir, "compute-sanitizer", "--url", url, "--send", "workload.py",
                         "--", *SANITIZER_OPTIONS, sys.executable, "workload.py", timeout=timeout)
    ok = result.returncode == 0 and "sum " in result.stdout and "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr
    return "kcoral run compute-sanitizer", ok, _tail(result)


def _check_absent(url: str, out_dir: str, tool: str, timeout: float) -> tuple[str, bool, str]:
    """Not installed here: the command must say so in one line and exit 1."""
    profiling = ["--out", os.path.join(out_dir, f"{tool}-absent"), "--", "--", "python", "workload.py"]
    args = profiling if tool == "ncu" else ["--", "python", "workload.py"]
    result = _kcoral_run(out_dir, tool, "--url", url, *args, timeout=timeout)
    lines = result.stderr.strip().splitlines()
    ok = result.returncode == 1 and len(lines) == 1 and f"{tool} is not installed on the server" in lines[0]
    return f"kcoral run {tool} (not installed: one-line error)", ok, _tail(result)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        results = cli_tool_checks(sys.argv[1], scratch)
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)
