"""The README as a user with a vendored client reads it: client.py copied into a project whose
virtualenv holds NumPy alone (no kcoral, torch or ml_dtypes). The README's first example runs there
verbatim, `python client.py --help` is real help and `python client.py run` is `kcoral run`."""

import os
import shutil
import subprocess

import pytest

from tests.support import ROOT, ServerProcess, numpy_only_python, python_blocks

README = os.path.join(ROOT, "README.md")


@pytest.fixture(scope="module")
def python():
    return numpy_only_python()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(workers=1, tmp_path=tmp_path_factory.mktemp("vendored")) as srv:
        yield srv


@pytest.fixture
def project(tmp_path):
    """A project directory holding a copy of client.py and nothing else of ours."""
    shutil.copy(os.path.join(ROOT, "client.py"), tmp_path / "client.py")
    return tmp_path


def run_in(project, python, *argv, url=None, timeout=120):
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if url:
        env["KCORAL_URL"] = url
    return subprocess.run([python, *argv], cwd=project, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_environment_has_numpy_and_nothing_of_ours(project, python):
    done = run_in(project, python, "-c", "import importlib.util as u; import numpy; "
                  "print([n for n in ('kcoral', 'torch', 'ml_dtypes') if u.find_spec(n)])")
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr


def test_the_readme_first_example_runs_verbatim_with_a_vendored_client(project, python, server):
    line, code = python_blocks(README)[0]
    assert "from client import Client, Program" in code, f"README.md line {line} is not the first example"
    (project / "example.py").write_text(code)
    done = run_in(project, python, "example.py", url=server.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "{'sum': 5}\n"


def test_the_readme_is_a_front_page():
    with open(README, encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 200


def test_python_client_py_help_is_real_help(project, python):
    done = run_in(project, python, "client.py", "--help")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: python client.py run TOOL [options] -- ARGS...\n")
    for promise in ("from client import Client, Program", "from kcoral import Client, Program",
                    "`python client.py run` is `kcoral run`", "python", "ncu", "compute-sanitizer"):
        assert promise in done.stdout
    wrong = run_in(project, python, "client.py", "fly")
    assert wrong.returncode == 2 and wrong.stdout == "" and "usage: python client.py run" in wrong.stderr
    misused = run_in(project, python, "client.py", "run", "python", "job.py")
    assert misused.returncode == 2 and misused.stderr.startswith("usage: python client.py run python [options]")


def test_python_client_py_run_is_kcoral_run(project, python, server):
    (project / "job.py").write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    done = run_in(project, python, "client.py", "run", "python", "--send", "job.py", "--", "job.py", "x",
                  url=server.url)
    assert (done.returncode, done.stdout) == (3, "args ['x']\n"), done.stderr


def test_the_alias_the_help_gives_makes_the_docs_kcoral_run_lines_work(project, python, server):
    """`alias kcoral="python $PWD/client.py"`, as the help writes it, in a shell whose python is the
    project's: the docs' `kcoral run python --send ...` runs as written."""
    alias = next(line.strip() for line in run_in(project, python, "client.py", "--help").stdout.splitlines()
                 if line.strip().startswith("alias kcoral="))
    (project / "bench.py").write_text("import sys\nprint('size', sys.argv[2])\n")
    script = f"shopt -s expand_aliases\n{alias}\nkcoral run python --send bench.py -- bench.py --size 4096\n"
    env = {"PATH": f"{os.path.dirname(python)}:/usr/bin:/bin", "KCORAL_URL": server.url, "HOME": str(project)}
    done = subprocess.run(["bash", "-c", script], cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "size 4096\n"), done.stderr
