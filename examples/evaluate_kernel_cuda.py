# requires: gpu
"""`kcoral.builtins.evaluate` on a GPU server: CUDA inputs, the L2 flush, a CUDA graph, NVML.

The same judgement as evaluate_kernel.py with torch kernels on the GPU: a row-wise softmax over
a 1024 x 1024 float32 matrix, the reference written out in elementary operations (several
kernels), the candidate `torch.softmax` (one), and a candidate that does its work on a side
stream and returns without waiting for it.  `make_inputs` returns CUDA tensors, so each kernel
process copies its inputs from the shared region to the GPU inside the timed window, and holds
its results in host memory only after a device-wide synchronisation: the side stream's work is
counted, and the process is stopped before they are read.  Before each round the evaluating
process zeroes a buffer twice
the L2's size on the same GPU.  The vectorised candidate is judged twice, the second time with
`cuda_graph=True` (captured once, replayed each call).  The verdict records the GPU's clocks,
temperature and throttle reasons before and after the race (NVML, when nvidia-ml-py is
installed) and flags a change.

Expect the correctness verdicts to be the point here: the race's clock includes the exchange
copies of 4 MiB each way between host and device (the empty round trip subtracts their median),
so kernels of tens of microseconds may come out `within_noise` (docs/evaluate.md, "What is exact").

Prints one line per judgement: the status, the message, the flags, and the SM clock before and
after.  Exit status 0 when all three candidates are correct.
"""

import os
import sys

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

REFERENCE = """
import torch

def kernel(x):
    shifted = x - x.max(dim=1, keepdim=True).values
    e = torch.exp(shifted)
    return e / e.sum(dim=1, keepdim=True)
"""

CANDIDATE = "import torch\n\ndef kernel(x):\n    return torch.softmax(x, dim=1)\n"

SIDE_STREAM = """
import torch

side = None

def kernel(x):
    global side
    if side is None:
        side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # returned before this finishes: evaluate waits for the device anyway
        out = torch.softmax(x, dim=1)
    return out
"""

HARNESS = """
import torch
from kcoral.builtins import evaluate

def make_inputs(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(1024, 1024, device="cuda", generator=generator)

def judge(candidate, reference, cuda_graph):
    return evaluate(candidate, reference, make_inputs, rtol=1e-5, atol=1e-6, cuda_graph=cuda_graph,
                    target_rse=0.01, budget_ms=3000)
"""


def main() -> int:
    program = Program()
    judge = program.get_function(module=program.upload(kind="module", source=HARNESS), name="judge")
    runs = {"softmax": (CANDIDATE, False), "softmax, CUDA graph": (CANDIDATE, True),
            "side stream": (SIDE_STREAM, False)}
    for key, (source, graph) in runs.items():
        program.return_(key=key, value=program.run(fn=judge, args=[source, REFERENCE, graph]))
    with Client(URL) as client:
        if client.health()["target"].get("arch") is None:
            print(f"{URL} is a CPU server: run evaluate_kernel.py instead", file=sys.stderr)
            return 2
        result = client.execute(program, timeout_seconds=300)
    ok = True
    for key in runs:
        verdict = result[key]
        ok = ok and verdict["correct"]
        gpu = (verdict["timing"] or {}).get("gpu") or {}
        clocks = [(reading or {}).get("sm_clock_mhz") for reading in (gpu.get("before"), gpu.get("after"))]
        print(f"{key}: {verdict['status']}: {verdict['message']}; flags {sorted(verdict['flags'])}; "
              f"SM clock {clocks[0]} -> {clocks[1]} MHz")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
