"""Per-request latency and CPU of two checkouts of this repository, side by side in one run.

    git worktree add /tmp/before main      # with .venv linked in, as in this checkout
    .venv/bin/python -m bench.compare_checkouts --before /tmp/before --trivial 50 --bursts 9 --folders 20

Starts four servers (each checkout, `--sandbox none` and `--sandbox bubblewrap`, 2 CPU workers
each) and drives them with our client: sequential trivial requests, alternating server by server,
each sample once every server is idle (bench/scenarios.py), then bursts of 4 clients x 10 trivial
requests, likewise alternating, then 500-file folders up and back (bench/scenarios.py, fresh files
each round).  For each burst it also reads the CPU time of the server's whole process tree
(front-end, forkserver or sandbox containers, the workers they reaped), per request, and likewise
over all the folder requests (their disk cache writes, which finish after the answer, included).
Prints the medians and, per checkout, sandboxed / unsandboxed.  On a shared machine the figures
move with its load: compare the checkouts within one run only.  Its trivial latency is biased by
a few milliseconds: one commit checked out twice read the first checkout's unsandboxed trivial
request 1.4-3.5 ms slower and its sandboxed one 1.6-1.8 ms faster, and with the two swapped in
the list the other way round: the bias goes with a server's place, not its code
(docs/performance.md).  Its burst CPU per request agreed within 4 %.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

from bench import scenarios
from bench.bench_servers import ROOT, Server

BURST_REQUESTS = 40  # scenario_burst: 4 clients x 10
SANDBOXES = ("none", "bubblewrap")


def load_client():
    """client.py of this checkout (both servers speak the same protocol)."""
    spec = importlib.util.spec_from_file_location("kcoral_client", os.path.join(ROOT, "client.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["kcoral_client"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def start_servers(checkouts, scratch):
    servers = []
    for sandbox in SANDBOXES:
        for name, root in checkouts.items():
            def argv(port, root=root, sandbox=sandbox, name=name):
                return [os.path.join(root, ".venv", "bin", "python"), "-m", "kcoral", "--port", str(port),
                        "--device", "cpu", "--log-dir", "", "--sandbox", sandbox, "--num-workers", "2",
                        "--no-log-console", "--disk-cache-dir", os.path.join(scratch, f"{name}-{sandbox}-cache")]
            servers.append(Server(f"{name}-{sandbox}", argv, scratch, cwd=root))
    for server in servers:
        server.wait_ready()
    return servers


def tree_cpu_seconds(root_pid):
    """CPU seconds of a process and all its descendants, with what each reaped (cutime, cstime)."""
    parents, cpu = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(name))
            cpu[int(name)] = sum(int(x) for x in fields[11:15])
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0)
        stack += parents.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def bursts(servers, rounds, client_class, program_class):
    """-> ({server: burst ms}, {server: server CPU ms per request})."""
    times = {server.name: [] for server in servers}
    cpu = {server.name: [] for server in servers}
    for _ in range(rounds):
        for server in servers:
            for other in servers:
                scenarios.wait_idle(other.url)
            before = tree_cpu_seconds(server.pid)
            times[server.name] += scenarios.scenario_burst([server], client_class, 1, program_class)[server.name]
            scenarios.wait_idle(server.url)  # the last replacements count too
            cpu[server.name].append((tree_cpu_seconds(server.pid) - before) / BURST_REQUESTS * 1e3)
    return times, cpu


def folders(servers, rounds, clients, client_class, program_class, scratch):
    """-> ({server: folder request ms}, {server: server CPU ms per folder request})."""
    before = {server.name: tree_cpu_seconds(server.pid) for server in servers}
    times = scenarios.scenario_folder(servers, clients, client_class, rounds, scratch, program_class)
    time.sleep(2)  # the last requests' disk cache writes, which follow their answers
    return times, {server.name: (tree_cpu_seconds(server.pid) - before[server.name]) / rounds * 1e3
                   for server in servers}


def report(checkouts, servers, columns):
    """A row per server, a column per scenario run (its median), then sandboxed / unsandboxed."""
    print(f"load average {os.getloadavg()}")
    print(f"{'server':24}" + "".join(f" {title:>14}" for title in columns))
    for server in servers:
        print(f"{server.name:24}" + "".join(f" {statistics.median(samples[server.name]):14.1f}"
                                            for samples in columns.values()))
    for name in checkouts:
        ratios = [f"{title} {statistics.median(samples[f'{name}-bubblewrap']) / statistics.median(samples[f'{name}-none']):.2f}"
                  for title, samples in columns.items() if "CPU" not in title]
        print(f"{name}: sandboxed / unsandboxed, {', '.join(ratios)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout (its .venv is used)")
    parser.add_argument("--trivial", type=int, default=50, help="sequential trivial requests per server")
    parser.add_argument("--bursts", type=int, default=9, help="bursts per server")
    parser.add_argument("--folders", type=int, default=0, help="500-file folder requests per server")
    args = parser.parse_args()
    checkouts = {"before": os.path.abspath(args.before), "after": ROOT}
    client = load_client()
    with tempfile.TemporaryDirectory(prefix="kcoral-compare-") as scratch:
        servers = start_servers(checkouts, scratch)
        try:
            clients = {server.name: client.Client(server.url) for server in servers}
            columns = {}
            if args.trivial:
                columns["trivial ms"] = scenarios.scenario_trivial(servers, clients, client.Client, args.trivial,
                                                                   client.Program)
            if args.bursts:
                columns["burst ms"], columns["burst CPU ms/req"] = bursts(servers, args.bursts, client.Client,
                                                                          client.Program)
            if args.folders:
                columns["folder ms"], cpu = folders(servers, args.folders, clients, client.Client, client.Program,
                                                    scratch)
                columns["folder CPU ms/req"] = {name: [ms] for name, ms in cpu.items()}
        finally:
            for server in servers:
                server.stop()
    report(checkouts, servers, columns)


if __name__ == "__main__":
    main()
