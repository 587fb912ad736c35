"""The product files as a user meets them: the import graph, the `kcoral.*` names, installation.

- kcoral.py, kcoral_worker.py and client.py import one another without a circle, and the
  client imports neither server file (it stays a standalone, copyable file).
- `from kcoral.errors import ExecutionError` and `from kcoral.builtins import ...` work in an
  ordinary process, as in the published package, and inside workers.
- `from kcoral import Client` gets our client whatever `client.py` lies on sys.path, and a
  non-editable install puts no generic `client` module into site-packages.
"""

import ast
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT, assert_completed, execute_ok, simple_program

PRODUCT_FILES = ("kcoral.py", "kcoral_worker.py", "client.py")
PRODUCT_MODULES = {name[:-3] for name in PRODUCT_FILES}
HOSTILE_CLIENT = 'raise SystemExit("the hostile client.py was imported")\n'


def imported_product_modules(path: str) -> set:
    """Product modules a file imports anywhere (module level or inside functions)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & PRODUCT_MODULES


def find_cycle(graph: dict) -> list:
    """A circle of the directed graph as a list of nodes, or [] when there is none."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                return stack[stack.index(successor):] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def import_graph() -> dict:
    return {name[:-3]: imported_product_modules(os.path.join(ROOT, name)) - {name[:-3]} for name in PRODUCT_FILES}


def test_product_import_graph_has_no_cycle():
    graph = import_graph()
    assert find_cycle(graph) == [], graph
    assert graph["client"] == set(), "client.py must stay standalone (vendorable by copying)"
    assert graph["kcoral_worker"] == set(), "the worker must never import the front-end back"
    assert graph["kcoral"] == {"kcoral_worker"}, graph


def test_cycle_finder_sees_a_circle():
    """The check above would catch the old kcoral.py <-> kcoral_worker.py circle."""
    assert find_cycle({"kcoral": {"kcoral_worker"}, "kcoral_worker": {"kcoral"}, "client": set()}) == \
        ["kcoral", "kcoral_worker", "kcoral"]


def run_python(code: str, cwd, pythonpath: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-c", code], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=120)


KCORAL_NAMES = """
from kcoral.errors import ExecutionError
from kcoral.builtins import benchmark, compile_tirx
import kcoral.errors, kcoral.builtins, kcoral
assert kcoral.errors.ExecutionError is ExecutionError and kcoral.builtins.benchmark is benchmark
err = ExecutionError("correctness", "off by one")
assert (err.kind, err.message) == ("correctness", "off by one"), (err.kind, err.message)
print("ok", callable(compile_tirx))
"""


def test_kcoral_errors_and_builtins_import_in_an_ordinary_process(tmp_path):
    result = run_python(KCORAL_NAMES, tmp_path, ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]


def test_kcoral_errors_and_builtins_import_inside_a_worker(server):
    source = ("from kcoral.errors import ExecutionError\nfrom kcoral.builtins import benchmark, compile_tirx\n"
              "def f():\n    return [ExecutionError.__name__, callable(benchmark), callable(compile_tirx)]\n")
    results = assert_completed(execute_ok(server.url, simple_program(source)))
    values = [item["value"] for item in results["out"]["value"]]
    assert values == ["ExecutionError", True, True], results


CLIENT_FROM_KCORAL = """
from kcoral import Client, Program
import kcoral
print(Client.__module__, kcoral.load_client().__file__)
"""


def test_client_from_kcoral_ignores_a_users_client_py(tmp_path):
    (tmp_path / "client.py").write_text(HOSTILE_CLIENT)
    result = run_python(CLIENT_FROM_KCORAL, tmp_path, ROOT)  # the cwd, holding client.py, comes first
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["kcoral_client", os.path.join(ROOT, "client.py")]


def test_installed_distribution_has_no_generic_client_module(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"
    source.mkdir()
    for name in (*PRODUCT_FILES, "setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source)  # a copy: the build leaves build/ and egg-info behind
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                              str(source)], cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    modules = sorted(name for name in os.listdir(target) if name.endswith(".py"))
    assert modules == ["kcoral.py", "kcoral_client.py", "kcoral_worker.py"], modules
    work = tmp_path / "work"
    work.mkdir()
    (work / "client.py").write_text(HOSTILE_CLIENT)
    result = run_python(CLIENT_FROM_KCORAL + KCORAL_NAMES, work, str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["kcoral_client", str(target / "kcoral_client.py"), "ok", "True"]


def test_ruff_finds_nothing():
    """The repository's lint configuration (pyproject.toml) holds for every tracked Python file."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing():
    """The type checker's configuration (pyproject.toml [tool.mypy]) holds for the product files."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "Success" in result.stdout, result.stdout + result.stderr


def test_no_tracked_file_points_outside_the_repository():
    """The repository stands alone: documents and tools it cites are its own."""
    found = subprocess.run(["git", "grep", "-nE", r"\.\./shared|shared/(spec|tools|seed)"], cwd=ROOT,
                           capture_output=True, text=True)
    if found.returncode == 128:
        pytest.skip("not a git checkout")
    assert found.stdout == "", found.stdout


def test_every_server_setting_is_documented():
    """docs/server.md §9.1 lists every ServerConfig field (the flags are generated from them)."""
    import dataclasses

    import kcoral

    with open(os.path.join(ROOT, "docs", "server.md")) as f:
        table = f.read().split("### 9.1", 1)[1].split("### 9.2", 1)[0]
    missing = [f.name for f in dataclasses.fields(kcoral.ServerConfig) if f"`{f.name}`" not in table]
    assert missing == []
