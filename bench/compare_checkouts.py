"""Per-request latency and CPU of two checkouts of this repository, side by side in one run.

    git worktree add /tmp/before main      # with .venv linked in, as in this checkout
    .venv/bin/python -m bench.compare_checkouts --before /tmp/before --trivial 50 --bursts 9

Starts four servers (each checkout, `--sandbox none` and `--sandbox bubblewrap`, 2 CPU workers
each) and drives them with our client: sequential trivial requests, alternating server by server,
each sample once every server is idle (bench/scenarios.py), then bursts of 4 clients x 10 trivial
requests, likewise alternating.  For each burst it also reads the CPU time of the server's whole
process tree (front-end, forkserver or sandbox containers, the workers they reaped), per request.
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


def report(checkouts, servers, trivial, burst, cpu):
    print(f"load average {os.getloadavg()}")
    print(f"{'server':24} {'trivial ms':>10} {'burst ms':>9} {'server CPU ms/request':>22}")
    for server in servers:
        name = server.name
        print(f"{name:24} {statistics.median(trivial[name]):10.2f} {statistics.median(burst[name]):9.0f} "
              f"{statistics.median(cpu[name]):22.1f}")
    for name in checkouts:
        ratios = [statistics.median(samples[f"{name}-bubblewrap"]) / statistics.median(samples[f"{name}-none"])
                  for samples in (trivial, burst)]
        print(f"{name}: sandboxed / unsandboxed, trivial {ratios[0]:.2f}, burst {ratios[1]:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout (its .venv is used)")
    parser.add_argument("--trivial", type=int, default=50, help="sequential trivial requests per server")
    parser.add_argument("--bursts", type=int, default=9, help="bursts per server")
    args = parser.parse_args()
    checkouts = {"before": os.path.abspath(args.before), "after": ROOT}
    client = load_client()
    with tempfile.TemporaryDirectory(prefix="kcoral-compare-") as scratch:
        servers = start_servers(checkouts, scratch)
        try:
            clients = {server.name: client.Client(server.url) for server in servers}
            trivial = scenarios.scenario_trivial(servers, clients, client.Client, args.trivial, client.Program)
            burst, cpu = bursts(servers, args.bursts, client.Client, client.Program)
        finally:
            for server in servers:
                server.stop()
    report(checkouts, servers, trivial, burst, cpu)


if __name__ == "__main__":
    main()
