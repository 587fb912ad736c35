# requires: gpu
"""A multi-GPU request: `execute(program, gpu_count=2)` runs the program in a worker that
sees two GPUs, as cuda:0 and cuda:1, under both GPUs' leases.

The server picks any free GPUs (the answer's `gpu_ids` says which physical ones); a server
with fewer GPUs than asked refuses the request with 400.  KCORAL_GPUS sets the count; by
default it is 2, or 1 on a one-GPU server (the program then runs on its one device, with no
copy between devices).  The program fills a tensor on every visible device, moves each to
the first device and adds them there, so each GPU and the copies between them really ran.
Prints the physical GPU ids, one line per device (its name and its sum), and the combined sum.
"""

import os

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

SOURCE = """
import torch

def per_device(n):
    devices = [torch.device("cuda", index) for index in range(torch.cuda.device_count())]
    parts = [torch.full((n,), float(index + 1), device=device) for index, device in enumerate(devices)]
    combined = sum(part.to(devices[0]) for part in parts)  # peer copies onto the first device
    return {"devices": [{"index": d.index, "name": torch.cuda.get_device_name(d), "sum": p.sum().item()}
                        for d, p in zip(devices, parts)],
            "combined_sum": combined.sum().item()}
"""


def main() -> None:
    with Client(URL) as client:
        available = client.health()["gpu_count"]
        gpus = int(os.environ.get("KCORAL_GPUS") or min(2, available))  # asked for, or what the server has
        if not 1 <= gpus <= available:
            raise SystemExit(f"{URL} has {available} GPU(s); this example asks for {gpus}")
        program = Program()
        per_device = program.get_function(module=program.upload(kind="module", source=SOURCE), name="per_device")
        program.return_(key="report", value=program.run(fn=per_device, args=[1024]))
        result = client.execute(program, gpu_count=gpus)
    if not result.completed:
        raise SystemExit(f"{result.error['kind']}: {result.error['message']}")
    print(f"physical GPUs: {list(result.gpu_ids)}")
    for device in result["report"]["devices"]:
        print(f"cuda:{device['index']} ({device['name']}): sum {device['sum']}")
    print(f"combined sum: {result['report']['combined_sum']}")


if __name__ == "__main__":
    main()
