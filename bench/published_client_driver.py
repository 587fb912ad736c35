"""The timed scenarios of bench/bench_servers.py, driven by the published kcoral 0.1.1 client.

Run by the reference virtualenv's python, from outside the repository (bench_servers.py does):

    <reference python> bench/published_client_driver.py SPEC.json OUT.json

SPEC names the servers ([[name, url], ...] in alternation order), the scenarios, the sample
counts and a scratch directory; OUT receives {scenario key: {server name: samples}}.  The floor
records from the server named "ours".  Only bench/scenarios.py and bench/floor_server.py (both
standard library only) are imported from this directory: `kcoral` must be the published package.
"""

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scenarios  # noqa: E402
from floor_server import FloorServer  # noqa: E402

import kcoral  # noqa: E402  (the published package, from the virtualenv)


class CountingClient(kcoral.Client):
    """The published client, counting what each execute() puts on the wire: POSTs and blob bytes."""

    def execute(self, program, **options):
        self.posts, self.blob_bytes = 0, 0
        return super().execute(program, **options)

    def _post_program(self, program, options, include_blobs, route):
        self.posts += 1
        self.blob_bytes += sum(len(data) for blob_hash, data in program._blobs.items() if blob_hash in include_blobs)
        return super()._post_program(program, options, include_blobs, route)


def main():
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    assert kcoral.__version__ == "0.1.1", kcoral.__file__
    servers = [types.SimpleNamespace(name=name, url=url) for name, url in spec["servers"]]
    ours = next(server for server in servers if server.name == "ours")
    floor = FloorServer(ours.url)  # forked before any thread starts; records from ours
    clients = {server.name: CountingClient(server.url) for server in (*servers, floor)}
    try:
        raw = scenarios.run_timed_scenarios(spec["scenarios"], servers, clients, kcoral.Client, spec["counts"],
                                            spec["scratch"], kcoral.Program,
                                            lambda line: print(f"published client: {line}", file=sys.stderr), floor)
    finally:
        for client in clients.values():
            client.close()
        floor.stop()
    with open(out_path, "w") as f:
        json.dump(raw, f)


if __name__ == "__main__":
    main()
