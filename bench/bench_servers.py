"""Side-by-side benchmark: our server against the published kcoral 0.1.1, same client.

    .venv/bin/python -m bench.bench_servers            # 1.5 to 3 minutes on 2 cores

Starts both servers on CPU with the same worker count (2) and the same flags,
drives both with our client (client.py), alternating published/ours request by
request so that machine drift hits both alike, and reports per scenario the
median and p90 of each server and the ratio ours/published (of the medians).
Writes bench/results.json, bench/results.png and bench/RESULTS.md (the README
section) and prints the Markdown table.

Fairness notes:
- Only `Client.execute` is timed; building the program (hashing its blobs) and
  checking the answer happen outside the clock, identically for both servers.
- Every 64 MiB round trip uploads a fresh random payload, so both servers first
  answer CACHE_MISS and then receive the 64 MiB (our client asks first for big
  blobs, like the published one).  The cache-hit scenario re-sends the same
  program: both servers answer from their memory cache on the first attempt.
- The folder scenario uses fresh file contents in every round, so both servers
  really receive 500 files each time.
- Both servers get `--max-request-bytes 512 MiB` so that a 256 MiB payload plus
  its multipart framing is accepted; everything else is at the defaults, except
  private disk-cache directories and no log files or console logging.
- Both servers' TMPDIR (where each puts its request workspaces) and disk caches
  live in one fresh scratch directory (under --scratch-parent, default the system
  temp dir).  Creating ~1000 small files per folder request dominates that scenario
  for both servers, and what a file creation costs varies a lot on a shared disk,
  so the report states what it cost during the run.
"""

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from client import Client, Program  # our client, for both servers
from tests.support import reference_popen_options, reference_server_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKERS = 2
MIB = 1 << 20
COMMON_FLAGS = ["--num-workers", str(WORKERS), "--no-log-console", "--max-request-bytes", str(512 * MIB)]
TRIVIAL_SOURCE = "def f():\n    return 42\n"
STDOUT_BYTES = 4 * MIB
STDOUT_SOURCE = f"import sys\n\ndef f():\n    sys.stdout.write('x' * {STDOUT_BYTES})\n    return 1\n"
FOLDER_FILES = 500
RSS_PAYLOAD = 256 * MIB
RSS_TARGET_TIMES_PAYLOAD = 3.0
SANDBOX_COST_TARGET = 1.5  # ours sandboxed / ours unsandboxed

# (key, title, unit, target ratio ours/published or None)
SCENARIOS = [
    ("trivial", "trivial request latency (sequential)", "ms", 0.15),
    ("burst", "burst: 4 clients x 10 trivial, total wall time", "ms", 0.10),
    ("bytes64", "64 MiB bytes round trip (fresh payload)", "ms", 0.35),
    ("cachehit64", "64 MiB cache hit (same blob again)", "ms", 0.25),
    ("folder", f"{FOLDER_FILES}-file folder upload + return", "ms", 0.40),
    ("stdout4", "4 MiB of stdout captured", "ms", 0.60),
    ("trivial_sandboxed", "trivial request latency, both `--sandbox bubblewrap`", "ms", None),
    ("rss256", "256 MiB upload: peak tree RSS increase", "MiB", None),
    ("pss256", "256 MiB upload: peak tree PSS increase", "MiB", None),
]


# --- servers ---------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on a free loopback port, logs into the scratch directory."""

    def __init__(self, name, argv_for_port, scratch, cwd=ROOT, env=os.environ):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(scratch, f"{name}.log")
        self.log = open(self.log_path, "wb")
        tmpdir = os.path.join(scratch, f"{name}-tmp")  # its request workspaces
        os.mkdir(tmpdir)
        self.proc = subprocess.Popen(argv_for_port(self.port), cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**env, "TMPDIR": tmpdir})

    @property
    def pid(self):
        return self.proc.pid

    def health(self):
        with urllib.request.urlopen(self.url + "/health", timeout=10) as response:
            return json.load(response)

    def wait_ready(self, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited:\n{self.log_tail()}")
            try:
                self.health()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} server did not start:\n{self.log_tail()}")

    def wait_idle(self, timeout=30):
        """Until every worker slot is ready again (replacements run after each request)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = self.health()["load"]
            if load["request_capacity"] == WORKERS and load["requests_in_progress"] == 0:
                return
            time.sleep(0.02)

    def log_tail(self):
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def start_servers(scratch):
    """-> (published, ours), both started in parallel and ready."""
    def published_argv(port):
        return reference_server_argv(port, "--disk-cache-dir", os.path.join(scratch, "published-cache"),
                                     *COMMON_FLAGS)

    def ours_argv(port):
        return [sys.executable, "-m", "kcoral", "--port", str(port), "--device", "cpu", "--log-dir", "",
                "--sandbox", "none", "--disk-cache-dir", os.path.join(scratch, "ours-cache"), *COMMON_FLAGS]

    # the published server runs outside the repository, from its own cached virtualenv
    servers = (Server("published", published_argv, scratch, **reference_popen_options()),
               Server("ours", ours_argv, scratch))
    for server in servers:
        server.wait_ready()
    return servers


def start_sandboxed_servers(scratch):
    """-> (published, ours), both with `--sandbox bubblewrap`; the published one from /tmp."""
    def published_argv(port):
        return reference_server_argv(port, "--sandbox", "bubblewrap", "--disk-cache-dir",
                                     os.path.join(scratch, "published-sandboxed-cache"), *COMMON_FLAGS)

    def ours_argv(port):
        return [sys.executable, "-m", "kcoral", "--port", str(port), "--device", "cpu", "--log-dir", "",
                "--sandbox", "bubblewrap", "--disk-cache-dir", os.path.join(scratch, "ours-sandboxed-cache"),
                *COMMON_FLAGS]

    servers = (Server("published-sandboxed", published_argv, scratch, **{**reference_popen_options(), "cwd": "/tmp"}),
               Server("ours-sandboxed", ours_argv, scratch))
    for server in servers:
        server.wait_ready()
    return servers


class CountingClient(Client):
    """Our client, counting what each execute() puts on the wire: the POSTs and blob bytes.

    The benchmark checks with it that a fresh 64 MiB payload really travels to both
    servers (CACHE_MISS, then the upload) and that a cache hit sends nothing.
    """

    def execute(self, program, **options):
        self.posts, self.blob_bytes = 0, 0
        return super().execute(program, **options)

    def _post_execute(self, program_json, blobs, *routing):
        self.posts += 1
        self.blob_bytes += sum(memoryview(data).nbytes for _, data in blobs)
        return super()._post_execute(program_json, blobs, *routing)


# --- memory of a process tree ------------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def process_tree(root):
    """The pid and all its live descendants, from one scan of /proc."""
    children = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if fields[0] != b"Z":
                children[int(fields[1])].append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_rss(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):  # gone meanwhile: counts 0
            continue
    return total


def tree_pss(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            continue
    return total


def tree_memory(root):
    """(RSS bytes, PSS bytes) summed over the process tree."""
    pids = process_tree(root)
    return tree_rss(pids), tree_pss(pids)


class TreeSampler:
    """Samples a tree's RSS and PSS every ~10 ms, keeping the peaks.

    RSS (statm) is cheap; PSS (smaps_rollup) walks every mapping, milliseconds per
    torch-sized process, so each has its own thread and RSS keeps its pace.
    """

    def __init__(self, root, interval=0.01):
        self.root = root
        self.interval = interval
        self.peaks = {"rss": 0, "pss": 0}
        self.samples = {"rss": 0, "pss": 0}
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.sample, args=(kind, measure), daemon=True)
                        for kind, measure in (("rss", tree_rss), ("pss", tree_pss))]

    def __enter__(self):
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        elapsed_ms = (time.monotonic() - self.started) * 1e3
        self.mean_interval_ms = {kind: elapsed_ms / max(1, n) for kind, n in self.samples.items()}

    def sample(self, kind, measure):
        while True:
            tick = time.monotonic()
            self.peaks[kind] = max(self.peaks[kind], measure(process_tree(self.root)))
            self.samples[kind] += 1
            if self.stopping.wait(max(0.0, self.interval - (time.monotonic() - tick))):
                return


# --- programs ----------------------------------------------------------------

def trivial_program():
    program = Program()
    module = program.upload(kind="module", source=TRIVIAL_SOURCE)
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn))
    return program


def echo_bytes_program(payload):
    program = Program()
    program.return_(key="out", value=program.upload(kind="bytes", value=payload))
    return program


def length_program(payload):
    program = Program()
    data = program.upload(kind="bytes", value=payload)
    module = program.upload(kind="module", source="def f(b):\n    return len(b)\n")
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn, args=[data]))
    return program


def stdout_program():
    program = Program()
    module = program.upload(kind="module", source=STDOUT_SOURCE)
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn))
    return program


def make_folder(directory, round_number):
    """FOLDER_FILES small files with fresh contents, spread over 10 sub-directories."""
    files = {}
    for i in range(FOLDER_FILES):
        rel = f"d{i % 10}/f{i:03d}.txt"
        data = f"round {round_number} file {i} ".encode() + os.urandom(256 + 8 * (i % 64))
        os.makedirs(os.path.join(directory, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(directory, rel), "wb") as f:
            f.write(data)
        files[rel] = data
    return files


def folder_program(directory):
    program = Program()
    program.upload_folder(directory, path="in")
    program.return_folder(key="out", path="in")
    return program


def check(condition, what):
    if not condition:
        raise AssertionError(f"benchmark answer check failed: {what}")


def completed(result):
    check(result.completed, f"program did not complete: {result.error}")
    return result


# --- scenarios ---------------------------------------------------------------

def timed(fn):
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1e3, value


def alternate(servers, rounds, once):
    """Run `once(server)` -> sample for published, ours, published, ours, ... -> {name: [samples]}."""
    samples = {server.name: [] for server in servers}
    for _ in range(rounds):
        for server in servers:
            samples[server.name].append(once(server))
    return samples


def scenario_trivial(servers, clients, rounds):
    program = trivial_program()
    for server in servers:  # warm-up: connection, first-request paths
        completed(clients[server.name].execute(program))

    def once(server):
        ms, result = timed(lambda: clients[server.name].execute(program))
        check(completed(result)["out"] == 42, "trivial result")
        return ms
    return alternate(servers, rounds, once)


def scenario_burst(servers, rounds, concurrency=4, per_client=10):
    program = trivial_program()
    pools = {server.name: [Client(server.url) for _ in range(concurrency)] for server in servers}

    def once(server):
        server.wait_idle()
        barrier = threading.Barrier(concurrency + 1)
        errors = []

        def drive(client):
            barrier.wait()
            try:
                for _ in range(per_client):
                    check(completed(client.execute(program))["out"] == 42, "burst result")
            except Exception as exc:  # reported after the round
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(c,)) for c in pools[server.name]]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        ms = (time.perf_counter() - start) * 1e3
        if errors:
            raise errors[0]
        return ms

    try:
        return alternate(servers, rounds, once)
    finally:
        for pool in pools.values():
            for client in pool:
                client.close()


def scenario_sandbox(ours, scratch, trivial_rounds, burst_rounds):
    """Trivial latency of both servers sandboxed, and what the sandbox costs ours: trivial and
    burst with and without it, all alternating -> (trivial_sandboxed, sandbox_cost) raw samples."""
    sandboxed = start_sandboxed_servers(scratch)
    try:
        clients = {server.name: Client(server.url) for server in (*sandboxed, ours)}
        trivial = scenario_trivial((*sandboxed, ours), clients, trivial_rounds)
        burst = scenario_burst((ours, sandboxed[1]), burst_rounds)
        for client in clients.values():
            client.close()
    finally:
        for server in sandboxed:
            server.stop()
    return ({"published": trivial["published-sandboxed"], "ours": trivial["ours-sandboxed"]},
            {"trivial": {"unsandboxed": trivial["ours"], "sandboxed": trivial["ours-sandboxed"]},
             "burst": {"unsandboxed": burst["ours"], "sandboxed": burst["ours-sandboxed"]}})


def sandbox_cost_table(cost):
    """Markdown: ours with and without the sandbox, side by side."""
    lines = ["| ours | unsandboxed median / p90 | sandboxed median / p90 | sandboxed/unsandboxed | target | met? |",
             "|---|---|---|---|---|---|"]
    titles = {"trivial": "trivial request latency (sequential)", "burst": "burst: 4 clients x 10 trivial, wall time"}
    for key, title in titles.items():
        plain, boxed = summary(cost[key]["unsandboxed"]), summary(cost[key]["sandboxed"])
        ratio = boxed["median"] / plain["median"]
        met = "yes" if ratio <= SANDBOX_COST_TARGET else "**no**"
        lines.append(f"| {title} | {fmt(plain['median'], 'ms')} / {fmt(plain['p90'], 'ms')} | "
                     f"{fmt(boxed['median'], 'ms')} / {fmt(boxed['p90'], 'ms')} | {ratio:.2f} | "
                     f"≤ {SANDBOX_COST_TARGET:g} | {met} |")
    return "\n".join(lines)


def scenario_bytes64(servers, clients, rounds):
    """-> (round trip samples, cache hit samples): each round's fresh payload is then re-sent."""
    trips = {server.name: [] for server in servers}
    hits = {server.name: [] for server in servers}
    for _ in range(rounds):
        payload = os.urandom(64 * MIB)
        program = echo_bytes_program(payload)
        for samples, posts, uploaded in ((trips, 2, 64 * MIB), (hits, 1, 0)):
            for server in servers:
                client = clients[server.name]
                ms, result = timed(lambda: client.execute(program))
                check(completed(result)["out"] == payload, "64 MiB payload returned intact")
                check((client.posts, client.blob_bytes) == (posts, uploaded),
                      f"{server.name}: {client.posts} POSTs with {client.blob_bytes} blob bytes, "
                      f"expected {posts} with {uploaded}")
                samples[server.name].append(ms)
                del result
    return trips, hits


def scenario_folder(servers, clients, rounds, scratch):
    def once_for_round(round_number):
        directory = os.path.join(scratch, f"folder-{round_number}")
        files = make_folder(directory, round_number)
        program = folder_program(directory)
        shutil.rmtree(directory)
        return files, program

    samples = {server.name: [] for server in servers}
    for round_number in range(rounds):
        files, program = once_for_round(round_number)
        for server in servers:
            ms, result = timed(lambda: clients[server.name].execute(program))
            returned = completed(result)["out"]
            check({rel: f.read_bytes() for rel, f in returned.files.items()} == files, "folder returned intact")
            samples[server.name].append(ms)
    return samples


def scenario_stdout(servers, clients, rounds):
    program = stdout_program()

    def once(server):
        ms, result = timed(lambda: clients[server.name].execute(program, output_limit_bytes=2 * STDOUT_BYTES))
        check(len(completed(result).stdout) == STDOUT_BYTES and not result.stdout_truncated, "4 MiB stdout")
        return ms
    return alternate(servers, rounds, once)


def scenario_memory(servers, clients, rounds):
    """Peak tree RSS/PSS increase over the idle tree while a 256 MiB upload runs."""
    rss = {server.name: [] for server in servers}
    pss = {server.name: [] for server in servers}
    detail = {server.name: [] for server in servers}
    for _ in range(rounds):
        payload = os.urandom(RSS_PAYLOAD)
        program = length_program(payload)
        for server in servers:
            server.wait_idle()
            time.sleep(0.3)
            idle_rss, idle_pss = tree_memory(server.pid)
            with TreeSampler(server.pid) as sampler:
                result = clients[server.name].execute(program)
            check(completed(result)["out"] == RSS_PAYLOAD, "256 MiB upload length")
            peak_rss, peak_pss = sampler.peaks["rss"], sampler.peaks["pss"]
            rss[server.name].append((peak_rss - idle_rss) / MIB)
            pss[server.name].append((peak_pss - idle_pss) / MIB)
            detail[server.name].append({
                "idle_rss_mib": idle_rss / MIB, "peak_rss_mib": peak_rss / MIB,
                "idle_pss_mib": idle_pss / MIB, "peak_pss_mib": peak_pss / MIB,
                "samples": sampler.samples, "mean_sample_interval_ms": sampler.mean_interval_ms})
        del payload, program
    return rss, pss, detail


# --- report ------------------------------------------------------------------

def summary(values):
    ordered = sorted(values)
    p90 = statistics.quantiles(ordered, n=10, method="inclusive")[8] if len(ordered) > 1 else ordered[0]
    return {"median": statistics.median(ordered), "p90": p90, "samples": values}


def file_create_ms(parent, count=200):
    """Mean cost of creating a small file under `parent`: the folder scenario's main expense."""
    directory = tempfile.mkdtemp(dir=parent)
    try:
        start = time.perf_counter()
        for i in range(count):
            with open(os.path.join(directory, f"f{i}"), "xb") as f:
                f.write(b"x" * 512)
        return (time.perf_counter() - start) * 1e3 / count
    finally:
        shutil.rmtree(directory)


def machine():
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": model, "ram_gib": round(mem_kib / (1 << 20), 1),
            "kernel": platform.release(), "python": platform.python_version()}


def evaluate(raw):
    """{scenario: {name: samples}} -> rows with medians, p90s, ratio and verdict."""
    rows = []
    for key, title, unit, target in SCENARIOS:
        if key not in raw:
            continue
        published, ours = summary(raw[key]["published"]), summary(raw[key]["ours"])
        ratio = ours["median"] / published["median"] if published["median"] else None
        row = {"key": key, "scenario": title, "unit": unit, "published": published, "ours": ours,
               "ratio": ratio, "target": target, "met": None if target is None else ratio <= target}
        if key in ("rss256", "pss256"):
            times_payload = ours["median"] * MIB / RSS_PAYLOAD
            row["ours_times_payload"] = times_payload
            row["target_text"] = f"ours ≤ {RSS_TARGET_TIMES_PAYLOAD:g}× payload"
            if key == "rss256":  # the target is judged on the RSS increase
                row["met"] = times_payload <= RSS_TARGET_TIMES_PAYLOAD
        rows.append(row)
    return rows


def fmt(value, unit):
    if unit == "MiB":
        return f"{value:.0f} MiB"
    return f"{value / 1e3:.2f} s" if unit == "s" else f"{value:.1f} ms"


def markdown_table(rows):
    lines = ["| scenario | published median / p90 | ours median / p90 | ours/published | target | met? |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        unit = row["unit"]
        if unit == "ms" and max(row["published"]["median"], row["ours"]["median"]) >= 1e4:
            unit = "s"  # the same unit for both servers in a row
        target = row.get("target_text") or (f"≤ {row['target']:g}" if row["target"] is not None else "—")
        if "ours_times_payload" in row:
            target += f" (ours: {row['ours_times_payload']:.2f}×)"
        met = {True: "yes", False: "**no**", None: "—"}[row["met"]]
        lines.append(f"| {row['scenario']} | {fmt(row['published']['median'], unit)} / "
                     f"{fmt(row['published']['p90'], unit)} | {fmt(row['ours']['median'], unit)} / "
                     f"{fmt(row['ours']['p90'], unit)} | {row['ratio']:.2f} | {target} | {met} |")
    return "\n".join(lines)


def draw_chart(rows, path, when):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.2))
    names = [row["key"] for row in rows]
    ratios = [row["ratio"] for row in rows]
    colors = ["#2a9d8f" if row["met"] is not False else "#e76f51" for row in rows]
    bars = ax.bar(names, ratios, color=colors)
    for i, row in enumerate(rows):
        if row["target"] is not None:
            ax.hlines(row["target"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.5,
                      label="target" if i == 0 else None)
        label = f"{row['ratio']:.2f}"
        if "ours_times_payload" in row:
            label += f"\n({row['ours_times_payload']:.1f}× payload)"
        ax.annotate(label, (bars[i].get_x() + bars[i].get_width() / 2, bars[i].get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("ours / published (median; lower is better)")
    ax.set_title(f"KCoral: ours vs published 0.1.1, {WORKERS} CPU workers each ({when})")
    ax.legend(loc="upper left")
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_markdown(rows, info):
    m = info["machine"]
    return f"""## Performance against the published server

Same client (ours), same worker count ({WORKERS} CPU workers), requests alternating
published/ours so that machine drift affects both alike; ratios are ours/published of the
medians (lower is better); only `Client.execute` is timed.  The 256 MiB memory rows are
the increase of the server's whole process tree (front-end, workers and helpers) over its
idle tree measured just before, sampled from /proc every {info['sample_interval_ms']['rss']:.0f} ms (RSS) and
{info['sample_interval_ms']['pss']:.0f} ms (PSS, from smaps_rollup); **the target is judged on that increase of tree
RSS** attributable to the upload (PSS, which splits pages a forked worker shares with its
template, is shown as well).  Neither counts the page cache, where our front-end stages a
request's blobs as one file for its worker.  Both servers keep their workspaces (TMPDIR)
and disk caches under `{info['scratch_parent']}`, where creating a small file took
{info['file_create_ms']:.2f} ms at the end of the run: the folder scenario's main cost for both servers.

{markdown_table(rows)}

![](bench/results.png)

What the sandbox costs ours (`--sandbox bubblewrap` against `--sandbox none`, alternating):

{sandbox_cost_table(info["sandbox_cost"])}

Machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, Linux {m['kernel']},
Python {m['python']}; {info['date']}; full run {info['wall_seconds']:.0f} s.

Reproduce: `.venv/bin/python -m bench.bench_servers` (needs `pip install matplotlib`, the `bench`
extra; the published server installs itself into a cached virtualenv on first use).
"""


# --- main --------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="samples per server for the heavy scenarios")
    parser.add_argument("--burst-rounds", type=int, default=3, help="bursts per server (the published one "
                        "takes ~15 s each)")
    parser.add_argument("--trivial", type=int, default=30, help="sequential trivial requests per server")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="output directory")
    parser.add_argument("--scratch-parent", help="where the servers' TMPDIR and disk caches go "
                        "(default: the system temp dir)")
    parser.add_argument("--sandbox-only", action="store_true", help="only the sandbox rows, printed")
    args = parser.parse_args()
    if args.sandbox_only:
        return print_sandbox_rows(args)
    begun = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="kcoral-bench-", dir=args.scratch_parent)
    servers = ()
    try:
        servers = start_servers(scratch)
        print(f"servers ready in {time.monotonic() - begun:.1f} s", file=sys.stderr)
        clients = {server.name: CountingClient(server.url) for server in servers}
        raw = {}
        steps = [
            ("trivial", lambda: scenario_trivial(servers, clients, args.trivial)),
            (("rss256", "pss256", "rss_detail"), lambda: scenario_memory(servers, clients, 2)),
            ("burst", lambda: scenario_burst(servers, args.burst_rounds)),
            (("bytes64", "cachehit64"), lambda: scenario_bytes64(servers, clients, args.rounds)),
            ("folder", lambda: scenario_folder(servers, clients, args.rounds, scratch)),
            ("stdout4", lambda: scenario_stdout(servers, clients, args.rounds)),
            (("trivial_sandboxed", "sandbox_cost"),
             lambda: scenario_sandbox(servers[1], scratch, args.trivial, args.burst_rounds)),
        ]
        for keys, step in steps:
            started = time.monotonic()
            values = step()
            if isinstance(keys, str):
                keys, values = (keys,), (values,)
            raw.update(zip(keys, values))
            print(f"{'/'.join(keys)}: {time.monotonic() - started:.1f} s", file=sys.stderr)
        for client in clients.values():
            client.close()
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "workers": WORKERS, "wall_seconds": time.monotonic() - begun,
            "command": ".venv/bin/python -m bench.bench_servers", "flags_both": COMMON_FLAGS,
            "scratch_parent": args.scratch_parent or tempfile.gettempdir(),
            "file_create_ms": file_create_ms(args.scratch_parent), "sandbox_cost": raw["sandbox_cost"]}
    intervals = [run["mean_sample_interval_ms"] for runs in raw["rss_detail"].values() for run in runs]
    info["sample_interval_ms"] = {kind: statistics.mean(i[kind] for i in intervals) for kind in ("rss", "pss")}
    rows = evaluate(raw)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({**info, "rows": rows, "memory_detail": raw.get("rss_detail")}, f, indent=2)
    draw_chart(rows, os.path.join(args.out, "results.png"), info["date"])
    text = results_markdown(rows, info)
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write(text)
    print(text)


def print_sandbox_rows(args):
    """--sandbox-only: the sandboxed trivial row and the sandbox's cost, without the other scenarios."""
    scratch = tempfile.mkdtemp(prefix="kcoral-bench-", dir=args.scratch_parent)
    ours = Server("ours", lambda port: [sys.executable, "-m", "kcoral", "--port", str(port), "--device", "cpu",
                                        "--log-dir", "", "--sandbox", "none",
                                        "--disk-cache-dir", os.path.join(scratch, "ours-cache"),
                                        *COMMON_FLAGS], scratch)
    try:
        ours.wait_ready()
        trivial, cost = scenario_sandbox(ours, scratch, args.trivial, args.burst_rounds)
    finally:
        ours.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown_table(evaluate({"trivial_sandboxed": trivial})))
    print()
    print(sandbox_cost_table(cost))


if __name__ == "__main__":
    main()
