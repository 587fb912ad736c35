"""A remote function: decorate a plain function and call `.remote(...)` to run it on the server.

The client ships the function's source (it must be defined in a file, use no closure
variables and import what it needs inside its body), uploads NumPy arrays as tensors and
brings the return value back.  Calling the function normally still runs it locally.
Prints the norm computed remotely (32.0), a plain local call (`divide(6, 3)`: 2.0), then
what a failing remote call raises: RemoteExecutionError with the server's error kind and
message.
"""

import os

import numpy

from kcoral import Client, RemoteExecutionError

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")
client = Client(URL)


@client.function(timeout=60)  # timeout= here is execute()'s timeout_seconds= (docs/client.md §4.9)
def norm(x):
    import torch  # imported on the server: a tensor argument arrives as a torch tensor there

    return torch.linalg.norm(x).item()


@client.function()
def divide(a, b):
    return a / b


def main() -> None:
    ones = numpy.ones(1024, dtype="float32")
    print(f"remote norm: {norm.remote(ones)}")
    print(f"local call: divide(6, 3) = {divide(6, 3)}")  # no server involved
    try:
        divide.remote(1, 0)
    except RemoteExecutionError as exc:
        error = exc.result.error  # the FAILED ProgramResult rides on the exception
        print(f"remote failure: kind={error['kind']} message={error['message']!r}")
    client.close()


if __name__ == "__main__":
    main()
