"""Your first program: upload a module, look up a function, run it, return the result.

A program is an ordered list of instructions that one fresh worker process runs on the
server; only what a `return` selects comes back.  Prints the server's target and versions
(from /health), then `sum: 5` (computed on the server) and the server's timings.
"""

import os

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

SOURCE = """
def add(a, b):
    print(f"adding {a} and {b} on the server")  # captured: it comes back in result.stdout
    return a + b
"""


def main() -> None:
    with Client(URL) as client:
        health = client.health()  # GET /health: what the server compiles for and runs with
        print(f"server {URL}: target {health['target'] or 'cpu'}, versions {health['versions']}")

        program = Program()
        module = program.upload(kind="module", source=SOURCE)
        add = program.get_function(module=module, name="add")
        total = program.run(fn=add, args=[2, 3])
        program.return_(key="sum", value=total)

        result = client.execute(program)
        print(f"status: {result.status}")
        print(f"sum: {result['sum']}")
        print(f"stdout: {result.stdout.strip()}")
        print(f"timings: queued {result.queue_ms:.1f} ms, ran {result.elapsed_ms:.1f} ms")


if __name__ == "__main__":
    main()
