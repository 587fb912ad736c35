"""Judge a candidate kernel against a reference with `kcoral.builtins.evaluate`.

`evaluate(candidate, reference, make_inputs, ...)` takes the candidate's and the reference's
*source text*: each runs in a fresh process of its own on the server, fed each call's inputs
and answering its outputs as raw bytes, while the seeds, the clock, the comparison and the
verdict stay in the worker that called evaluate, which never runs the candidate's code.  It
checks the candidate on 3 input sets drawn from seeds chosen at call time, then races it
against the reference, call by call in alternation, every raced output checked too, and
returns a verdict: "correct", "incorrect" or "error", a one-line message, the checks and,
for a correct candidate, the speedup with a 95% interval and flags (within noise,
implausible speedup, ...).  docs/evaluate.md lists what it catches and what it cannot.

The kernel is a row-wise softmax over a 512 x 256 float32 matrix (NumPy, so this runs on
any server).  The reference loops over the rows; the candidate is vectorised; the cheat
computes its first answer honestly and returns it again for every later call, which a
harness that checks one input set, or checks before it times, lets through.

Prints one line per candidate: its verdict's status and message, and for the honest one
the speedup and the flags.  Exit status 0 when the honest candidate is correct and the
cheat is not.
"""

import os
import sys

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

REFERENCE = """
import numpy

def kernel(x):
    out = numpy.empty_like(x)
    for i, row in enumerate(x):  # one row at a time: the slow, obviously right version
        e = numpy.exp(row - row.max())
        out[i] = e / e.sum()
    return out
"""

CANDIDATE = """
import numpy

def kernel(x):
    e = numpy.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)
"""

CHEAT = """
import numpy

first = None

def kernel(x):
    global first
    if first is None:  # right once...
        e = numpy.exp(x - x.max(axis=1, keepdims=True))
        first = e / e.sum(axis=1, keepdims=True)
    return first       # ...then replayed, at no cost
"""

# Runs in the worker: make_inputs is trusted code, called with seeds the candidates never see.
HARNESS = """
import numpy
from kcoral.builtins import evaluate

def make_inputs(seed):
    return numpy.random.default_rng(seed).standard_normal((512, 256), dtype=numpy.float32)

def judge(candidate, reference):
    # rtol/atol default to the output dtype's (float32: 1.3e-6, 1e-5).  The race stops when the
    # relative standard error reaches 2%, or after 2 s; warm cache (flush_l2=False), since on a
    # CPU server each flush is a 64 MiB memset of ~10 ms, three a round
    return evaluate(candidate, reference, make_inputs, target_rse=0.02, budget_ms=2000, flush_l2=False)
"""


def judge(client: Client, candidate: str) -> dict:
    program = Program()
    judge_fn = program.get_function(module=program.upload(kind="module", source=HARNESS), name="judge")
    program.return_(key="verdict", value=program.run(fn=judge_fn, args=[candidate, REFERENCE]))
    return client.execute(program, timeout_seconds=120)["verdict"]


def main() -> int:
    with Client(URL) as client:
        honest, cheat = judge(client, CANDIDATE), judge(client, CHEAT)
    print(f"vectorised: {honest['status']}: {honest['message']}")
    if honest["timing"] is not None:
        timing = honest["timing"]
        if timing["speedup"] is not None:  # None: a kernel below the harness's resolution
            low, high = timing["speedup_ci"]
            high = "inf" if high is None else f"{high:.2f}"
            print(f"  speedup {timing['speedup']:.2f}x, 95% interval {low:.2f}-{high}, {timing['rounds']} rounds, "
                  f"flags {sorted(honest['flags'])}")
    print(f"replays its first answer: {cheat['status']}: {cheat['message'][:100]}")
    return 0 if honest["correct"] and not cheat["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
