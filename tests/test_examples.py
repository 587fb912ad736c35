"""examples/ run as a user runs them: each CPU example as `python examples/NAME.py` against a
real server, its output checked against what its comments promise.  GPU-only examples carry
`# requires: gpu` as their first line and are skipped here.  The Python blocks of the agent
skill (skills/kcoral-client/SKILL.md) run the same way, one script each, so neither can drift.
"""

import os
import re

import pytest

from tests.support import EXAMPLES_DIR, ROOT, ServerProcess, example_paths, python_blocks, requires_gpu, run_python

GPU_ONLY = {"evaluate_kernel_cuda.py", "kernel_loop_cuda.py", "multi_gpu.py"}
SKILL = os.path.join(ROOT, "skills", "kcoral-client", "SKILL.md")
SKILL_BLOCKS = python_blocks(SKILL)

# What each CPU example's docstring promises to print: patterns found in its stdout, in order.
PROMISES = {
    "hello_world.py": [r"target cpu, versions \{'tvm_ffi': '[^']+'\}", r"status: COMPLETED", r"sum: 5",
                       r"stdout: adding 2 and 3 on the server", r"timings: queued \d+\.\d ms, ran \d+\.\d ms"],
    "remote_function.py": [r"remote norm: 32\.0", r"local call: divide\(6, 3\) = 2\.0",
                           r"remote failure: kind=engine message='ZeroDivisionError: division by zero'"],
    "library_upload.py": [r"tvm_ffi: local (\S+), server \1 \(match\)", r"add\(40, 2\) = 42",
                          r"greet = hello, kcoral"],
    "compile_cpu_then_gpu.py": [r"compiled on http://\S+ for the host CPU: \d+ bytes",
                                r"y\[:4\] = \[0\.0, 1\.0, 2\.0, 3\.0\]", r"ok: True"],
    "benchmark_kernel.py": [r"defaults \{\}: median [\d.]+ us over (\d+) calls .*timer host, flush_l2 True",
                            r"explicit counts .*: median [\d.]+ us over 500 calls \(warmup 50, timer host",
                            r"no cache flush \{'flush_l2': False\}: median [\d.]+ us over \d+ calls"],
    "folder_round_trip.py": [r"sent: \['notes/todo\.txt', 'readme\.txt'\]",
                             r"returned: \['notes/todo\.txt', 'readme\.txt', 'summary\.txt'\]",
                             r"summary of 2 files:", r"notes/todo\.txt: 6 words", r"readme\.txt: 6 words"],
    "build_and_load.py": [r"scale\(2, \[0, 1, 2, 3\]\) = \[0\.0, 2\.0, 4\.0, 6\.0\]",
                          r"compile error at instruction 3 \(build\):",
                          r"kernel\.cc:7:\d+: error: .*data_pointer"],
    "evaluate_kernel.py": [r"vectorised: correct: correct on 3 input sets",
                           r"replays its first answer: incorrect: output 0 on input set 2 \(seed \d+\): check_close: "],
    "kernel_loop.py": [r"built axpy for the host CPU: \d+ bytes, n=65536",
                       r"check: check_close: 0 of 65536 elements differ",
                       r"benchmark: median [\d.]+ us, min [\d.]+ us over 100 calls"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("examples")) as srv:
        yield srv


@pytest.fixture(scope="module")
def run_example(server):
    """`python examples/NAME ARGS...` against the server -> CompletedProcess; each run once per module."""
    runs = {}

    def run(name, *args):
        if (name, args) not in runs:
            runs[name, args] = run_python(server.url, os.path.join(EXAMPLES_DIR, name), *args)
        return runs[name, args]
    return run


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def assert_in_order(output, patterns):
    """Each pattern matches a line of `output`, later than the previous pattern's line."""
    lines, at = output.splitlines(), 0
    for pattern in patterns:
        found = next((i for i in range(at, len(lines)) if re.search(pattern, lines[i])), None)
        assert found is not None, f"{pattern!r} not found after line {at} of:\n{output}"
        at = found + 1


def test_every_example_is_classified_and_checked():
    names = {os.path.basename(path) for path in example_paths()}
    assert {name for name in names if requires_gpu(read(os.path.join(EXAMPLES_DIR, name)))} == GPU_ONLY
    assert names - GPU_ONLY == set(PROMISES), "a CPU example without checked output, or a stale entry"


@pytest.mark.parametrize("path", example_paths(), ids=os.path.basename)
def test_example(run_example, path):
    if requires_gpu(read(path)):
        pytest.skip("# requires: gpu")
    done = run_example(os.path.basename(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert_in_order(done.stdout, PROMISES[os.path.basename(path)])


def test_default_benchmark_is_short_of_calls_on_cpu(run_example):
    """What benchmark_kernel.py's comments claim: on a CPU server the cache flush eats the default
    budget (the kernel's own time is under a tenth of the 100 ms measurement budget), so the
    defaults measure far fewer calls than the warm-cache run with the same budget."""
    done = run_example("benchmark_kernel.py")
    assert done.returncode == 0, done.stderr
    (median_us, defaults), (_, warm) = ((float(m.group(1)), int(m.group(2))) for m in (
        re.search(rf"^{label}.* median ([\d.]+) us over (\d+) calls", done.stdout, re.M)
        for label in ("defaults", "no cache flush")))
    assert defaults * median_us < 0.1 * 100_000 and warm > 10 * defaults, done.stdout


def test_broken_kernel_fails_its_check_and_still_reports(run_example):
    """The deliberately broken kernel (off by one): the gate fails the program with kind
    correctness, the check's report still comes back (it was returned before the gate),
    it names the one wrong element, and the kernel is never benchmarked."""
    done = run_example("kernel_loop.py", "--broken")
    assert done.returncode == 1, done.stdout + done.stderr
    assert_in_order(done.stdout, [r"built axpy \(broken\) for the host CPU",
                                  r"check: check_close: 1 of 65536 elements differ .*worst \[65535\]: 0\.0 vs ",
                                  r"FAILED correctness at instruction \d+ \(gate\)",
                                  r"out\[65535\] = 0\.0, expected [\d.]+", r"benchmark: skipped"])
    assert "benchmark: median" not in done.stdout



def test_the_guide_links_every_example():
    with open(os.path.join(EXAMPLES_DIR, os.pardir, "docs", "guide.md"), encoding="utf-8") as f:
        linked = set(re.findall(r"\]\(\.\./examples/([\w.]+\.py)\)", f.read()))
    assert {os.path.basename(path) for path in example_paths()} <= linked


def test_the_skill_has_front_matter_and_blocks_to_run():
    front = read(SKILL).split("---\n")
    assert front[0] == "" and re.search(r"^name: kcoral-client$", front[1], re.M)
    assert re.search(r"^description: .{40,}$", front[1], re.M)
    assert len(SKILL_BLOCKS) >= 8 and sum(requires_gpu(code) for _, code in SKILL_BLOCKS) == 2


@pytest.mark.parametrize("line, code", SKILL_BLOCKS, ids=[f"line{line}" for line, _ in SKILL_BLOCKS])
def test_skill_block(server, tmp_path, line, code):
    """Each block is a complete script: its own asserts are the check, so it must exit 0."""
    if requires_gpu(code):
        pytest.skip(f"SKILL.md line {line}: # requires: gpu")
    script = tmp_path / f"skill_block_{line}.py"
    script.write_text(code)
    done = run_python(server.url, str(script), cwd=str(tmp_path))
    assert done.returncode == 0, f"SKILL.md block at line {line}:\n{done.stdout}{done.stderr}"
