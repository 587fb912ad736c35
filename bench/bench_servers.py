"""Side-by-side benchmark: our server against the published kcoral 0.1.1, same client.

    .venv/bin/python -m bench.bench_servers            # 15 to 20 minutes on 2 cores
    .venv/bin/python -m bench.bench_servers --client ours --scenarios trivial,stdout_lines --samples 3

Starts both servers on CPU with the same worker count (2) and the same flags, drives both
with one client at a time, alternating published/ours request by request so that machine
drift hits both alike, and reports per scenario the median and p90 of each server, the
ratio ours/published (of the medians) and a 95% bootstrap interval of that ratio.  With
`--client both` (the default) the timed scenarios run twice: driven by our client
(client.py), then by the published client (bench/published_client_driver.py, run by the
published package's own virtualenv), one table each; the memory and sandbox rows, which
measure the servers alone, are taken with our client.  A complete run (every scenario, both
clients, the default sample counts) writes bench/results.json, bench/results.png and
bench/RESULTS.md (the README section); every run prints the Markdown tables.

Fairness notes:
- Only `Client.execute` is timed; building the program (hashing its blobs) and
  checking the answer happen outside the clock, identically for both servers.
- Every 64 MiB round trip uploads a fresh random payload to a function that returns
  it, so both servers first answer CACHE_MISS and then receive the 64 MiB (both clients
  ask first for big blobs), and hand it to the function and back.  The cache hit then
  sends the same blob to a function that takes its length: both servers find it in
  their memory cache on the first attempt.
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
- Each sample starts once the other servers are idle (bench/scenarios.py says why and what it
  means for the published server: its best case).
- Every timed scenario also times the client against the floor (bench/floor_server.py),
  which replays our server's recorded answer at once: the floor column is what that client
  and loopback cost alone, the lowest time any server could give that client; the tables
  print ours/floor and published/floor beside ours/published.
"""

import argparse
import collections
import datetime
import importlib.util
import json
import os
import platform
import random
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

from bench.floor_server import FloorServer
from bench.scenarios import (
    MIB,
    STDOUT_LINES,
    WORKERS,
    check,
    completed,
    run_timed_scenarios,
    scenario_burst,
    scenario_trivial,
    wait_idle,
)
from client import Client, Program  # our client
from tests.support import reference_popen_options, reference_python, reference_server_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON_FLAGS = ["--num-workers", str(WORKERS), "--no-log-console", "--max-request-bytes", str(512 * MIB)]
RSS_PAYLOAD = 256 * MIB
RSS_TARGET_TIMES_PAYLOAD = 3.0
SANDBOX_COST_TARGET = 1.5  # ours sandboxed / ours unsandboxed
CLIENTS = ("ours", "published")
TIMED = ("trivial", "burst", "bytes64", "folder", "stdout4", "stdout_lines")  # both clients run these
STEPS = (*TIMED, "memory", "sandbox")  # what --scenarios selects from (bytes64 brings cachehit64)
DEFAULT_COUNTS = {"trivial": 30, "burst": 3, "rounds": 5}
BOOTSTRAP_RESAMPLES = 2000

# (key, title, unit, target ratio ours/published or None)
SCENARIOS = [
    ("trivial", "trivial request latency (sequential)", "ms", 0.15),
    ("burst", "burst: 4 clients x 10 trivial, total wall time", "ms", 0.10),
    ("bytes64", "64 MiB bytes round trip (fresh payload; a function reads and returns it)", "ms", 0.30),
    ("cachehit64", "64 MiB cache hit (the same blob; a function takes its length)", "ms", 0.20),
    ("folder", "500-file folder upload + return", "ms", 0.40),
    ("stdout4", "4 MiB of stdout captured (one write)", "ms", 0.60),
    ("stdout_lines", f"4 MiB of stdout as {STDOUT_LINES} print() lines", "ms", 0.50),
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

    def wait_idle(self):
        wait_idle(self.url)

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
    servers (CACHE_MISS, then the upload) and that a cache hit sends nothing
    (bench/published_client_driver.py counts the same for the published client).
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


# --- the scenarios only our client drives ---------------------------------

def length_program(payload):
    program = Program()
    data = program.upload(kind="bytes", value=payload)
    module = program.upload(kind="module", source="def f(b):\n    return len(b)\n")
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn, args=[data]))
    return program


def scenario_sandbox(ours, scratch, trivial_rounds, burst_rounds):
    """Trivial latency of both servers sandboxed, and what the sandbox costs ours: trivial and
    burst with and without it, all alternating -> (trivial_sandboxed, sandbox_cost) raw samples."""
    sandboxed = start_sandboxed_servers(scratch)
    try:
        clients = {server.name: Client(server.url) for server in (*sandboxed, ours)}
        trivial = scenario_trivial((*sandboxed, ours), clients, Client, trivial_rounds, Program)
        burst = scenario_burst((ours, sandboxed[1]), Client, burst_rounds, Program)
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


def ratio_interval(published, ours, seed=0):
    """95% bootstrap interval of median(ours) / median(published): both sample sets resampled."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(ours, k=len(ours))) /
                    statistics.median(rng.choices(published, k=len(published)))
                    for _ in range(BOOTSTRAP_RESAMPLES))
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def evaluate(raw):
    """{scenario: {name: samples}} -> rows with medians, p90s, ratio, its interval and verdict."""
    rows = []
    for key, title, unit, target in SCENARIOS:
        if key not in raw:
            continue
        published, ours = summary(raw[key]["published"]), summary(raw[key]["ours"])
        ratio = ours["median"] / published["median"]
        row = {"key": key, "scenario": title, "unit": unit, "published": published, "ours": ours,
               "ratio": ratio, "ratio_95": ratio_interval(published["samples"], ours["samples"]),
               "target": target, "met": None if target is None else ratio <= target}
        if FloorServer.name in raw[key]:  # the client's own floor, and the lowest ratio it allows
            row["floor"] = summary(raw[key][FloorServer.name])
            row["floor_ratio"] = row["floor"]["median"] / published["median"]
            row["ours_over_floor"] = ours["median"] / row["floor"]["median"]
            row["published_over_floor"] = published["median"] / row["floor"]["median"]
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
    lines = ["| scenario | published median / p90 | ours median / p90 | ours/published (95% interval) | target | met? "
             "| floor median (lowest ours/published possible) | ours/floor | published/floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        unit = row["unit"]
        if unit == "ms" and max(row["published"]["median"], row["ours"]["median"]) >= 1e4:
            unit = "s"  # the same unit for both servers in a row
        target = row.get("target_text") or (f"≤ {row['target']:g}" if row["target"] is not None else "—")
        if "ours_times_payload" in row:
            target += f" (ours: {row['ours_times_payload']:.2f}×)"
        met = {True: "yes", False: "**no**", None: "—"}[row["met"]]
        low, high = row["ratio_95"]
        floor = (f"{fmt(row['floor']['median'], unit)} ({row['floor_ratio']:.2f}) | {row['ours_over_floor']:.1f}× | "
                 f"{row['published_over_floor']:.1f}×" if "floor" in row else "— | — | —")
        lines.append(f"| {row['scenario']} | {fmt(row['published']['median'], unit)} / "
                     f"{fmt(row['published']['p90'], unit)} | {fmt(row['ours']['median'], unit)} / "
                     f"{fmt(row['ours']['p90'], unit)} | {row['ratio']:.2f} ({low:.2f}–{high:.2f}) | "
                     f"{target} | {met} | {floor} |")
    return "\n".join(lines)


def client_tables(rows_by_client):
    """One Markdown table per client that drove the servers."""
    titles = {"ours": "Driven by our client (client.py)",
              "published": "Driven by the published client (kcoral 0.1.1, its own virtualenv)"}
    return "\n\n".join(f"{titles[client]}:\n\n{markdown_table(rows)}" for client, rows in rows_by_client.items())


def draw_chart(rows_by_client, path, when):
    """Ratios per scenario, one bar per client, the targets dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.4))
    keys = [row["key"] for row in rows_by_client["ours"]]
    width = 0.8 / len(rows_by_client)
    shades = {"ours": ("#2a9d8f", "#e76f51"), "published": ("#8ecae6", "#f4a261")}
    for n, (client, rows) in enumerate(rows_by_client.items()):
        by_key = {row["key"]: row for row in rows}
        for i, key in enumerate(keys):
            if key not in by_key:
                continue
            row = by_key[key]
            met_color, missed_color = shades[client]
            x = i - 0.4 + width * (n + 0.5)
            low, high = row["ratio_95"]
            ax.bar(x, row["ratio"], width, color=missed_color if row["met"] is False else met_color,
                   yerr=[[row["ratio"] - low], [high - row["ratio"]]], capsize=2,
                   label=f"{client} client" if i == 0 else None)
            if "floor_ratio" in row:  # what the client and loopback alone cost, as a ratio: no server goes below
                ax.plot(x, row["floor_ratio"], marker="v", color="black", markersize=5,
                        label="floor" if n == 0 and i == 0 else None)
            label = f"{row['ratio']:.2f}"
            if "ours_times_payload" in row:
                label += f"\n({row['ours_times_payload']:.1f}× payload)"
            ax.annotate(label, (x, high), ha="center", va="bottom", fontsize=7)
    for i, row in enumerate(rows_by_client["ours"]):
        if row["target"] is not None:
            ax.hlines(row["target"], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.5,
                      label="target" if i == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("ours / published (median, 95% bootstrap interval; lower is better)")
    ax.set_title(f"KCoral: ours vs published 0.1.1, {WORKERS} CPU workers each ({when})")
    ax.legend(loc="upper left")
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_markdown(rows_by_client, info):
    m = info["machine"]
    return f"""## Performance against the published server

Same worker count ({WORKERS} CPU workers), requests alternating published/ours so that machine
drift affects both alike; ratios are ours/published of the medians (lower is better), with a
95% bootstrap interval; only `Client.execute` is timed.  The timed scenarios ran twice, driven
by our client and by the published one; the memory and sandbox rows, which measure the servers,
with our client.  The 256 MiB memory rows are
the increase of the server's whole process tree (front-end, workers and helpers) over its
idle tree measured just before, sampled from /proc every {info['sample_interval_ms']['rss']:.0f} ms (RSS) and
{info['sample_interval_ms']['pss']:.0f} ms (PSS, from smaps_rollup); **the target is judged on that increase of tree
RSS** attributable to the upload (PSS, which splits pages a forked worker shares with its
template, is shown as well).  Neither counts shared memory that no process maps: the memfds
in which our front-end stages a request's blobs for its worker, which maps a large `bytes` blob
from them (the pages it reads then count) and copies the others into objects of its own (those
are counted).  Both servers keep their workspaces (TMPDIR) and disk caches
under `{info['scratch_parent']}`, where creating a small file in a plain directory took
{info['file_create_ms']:.2f} ms at the end of the run, as it does in the published server's workspaces
(ours take their inodes from ext4 block groups of their own, docs/performance.md).

{client_tables(rows_by_client)}

![](bench/results.png)

What the sandbox costs ours (`--sandbox bubblewrap` against `--sandbox none`, alternating):

{sandbox_cost_table(info["sandbox_cost"])}

Machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, Linux {m['kernel']},
Python {m['python']}; {info['date']}; full run {info['wall_seconds']:.0f} s.

Reproduce: `.venv/bin/python -m bench.bench_servers` (needs `pip install matplotlib`, the `bench`
extra; the published server and client install themselves into a cached virtualenv on first use).
"""


# --- main --------------------------------------------------------------------

def progress(line):
    print(line, file=sys.stderr, flush=True)


def published_client_scenarios(names, servers, counts, scratch):
    """The timed scenarios driven by the published client, in a process of its virtualenv."""
    spec_path, out_path = os.path.join(scratch, "published-client-spec.json"), os.path.join(scratch, "published.json")
    with open(spec_path, "w") as f:
        json.dump({"servers": [[server.name, server.url] for server in servers], "scenarios": list(names),
                   "counts": counts, "scratch": scratch}, f)
    subprocess.run([reference_python(), os.path.join(ROOT, "bench", "published_client_driver.py"), spec_path,
                    out_path], check=True, **reference_popen_options())
    with open(out_path) as f:
        return json.load(f)


def our_client_steps(names, servers, counts, scratch):
    """The timed scenarios with our client, then the memory and sandbox rows -> raw samples."""
    floor = FloorServer(servers[1].url)  # forked before any thread starts; records from ours
    clients = {server.name: CountingClient(server.url) for server in (*servers, floor)}
    try:
        raw = run_timed_scenarios(names, servers, clients, Client, counts, scratch, Program, progress, floor)
    finally:
        floor.stop()
    extra = [("memory", ("rss256", "pss256", "rss_detail"), lambda: scenario_memory(servers, clients, 2)),
             ("sandbox", ("trivial_sandboxed", "sandbox_cost"),
              lambda: scenario_sandbox(servers[1], scratch, counts["trivial"], counts["burst"]))]
    for name, keys, step in extra:
        if name in names:
            started = time.monotonic()
            raw.update(zip(keys, step()))
            progress(f"{'/'.join(keys)}: {time.monotonic() - started:.1f} s")
    for client in clients.values():
        client.close()
    return raw


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", choices=("ours", "published", "both"), default="both",
                        help="which client drives both servers (default: both, one table each)")
    parser.add_argument("--scenarios", default=",".join(STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)} (default: all)")
    parser.add_argument("--samples", type=int, help="samples per server for every scenario (a quick run); "
                        "overrides --rounds, --burst-rounds and --trivial")
    parser.add_argument("--rounds", type=int, default=DEFAULT_COUNTS["rounds"],
                        help="samples per server for the heavy scenarios")
    parser.add_argument("--burst-rounds", type=int, default=DEFAULT_COUNTS["burst"],
                        help="bursts per server (the published one takes ~15 s each)")
    parser.add_argument("--trivial", type=int, default=DEFAULT_COUNTS["trivial"],
                        help="sequential trivial requests per server")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)), help="output directory")
    parser.add_argument("--scratch-parent", help="where the servers' TMPDIR and disk caches go "
                        "(default: the system temp dir)")
    parser.add_argument("--sandbox-only", action="store_true", help="only the sandbox rows, printed")
    args = parser.parse_args()
    args.names = [name for name in args.scenarios.split(",") if name]
    unknown = set(args.names) - set(STEPS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    args.counts = ({key: args.samples for key in DEFAULT_COUNTS} if args.samples else
                   {"trivial": args.trivial, "burst": args.burst_rounds, "rounds": args.rounds})
    args.clients = CLIENTS if args.client == "both" else (args.client,)
    # only a run of everything at the default counts replaces the committed results
    args.complete = set(args.names) == set(STEPS) and args.clients == CLIENTS and args.counts == DEFAULT_COUNTS
    return args


def main():
    args = parse_args()
    if args.sandbox_only:
        return print_sandbox_rows(args)
    begun = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="kcoral-bench-", dir=args.scratch_parent)
    servers = ()
    raw_by_client = {}
    try:
        servers = start_servers(scratch)
        progress(f"servers ready in {time.monotonic() - begun:.1f} s")
        for client in args.clients:
            if client == "ours" or set(args.names) & set(TIMED):
                progress(f"--- driven by {'our' if client == 'ours' else 'the published'} client")
                raw_by_client[client] = (our_client_steps(args.names, servers, args.counts, scratch)
                                         if client == "ours" else
                                         published_client_scenarios([n for n in args.names if n in TIMED], servers,
                                                                    args.counts, scratch))
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    rows_by_client = {client: evaluate(raw) for client, raw in raw_by_client.items()}
    print(client_tables(rows_by_client))
    ours_raw = raw_by_client.get("ours", {})
    if "sandbox_cost" in ours_raw:
        print("\n" + sandbox_cost_table(ours_raw["sandbox_cost"]))
    if not args.complete:
        progress("a partial run: bench/RESULTS.md, results.json and results.png are left as they are")
        return
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "workers": WORKERS, "wall_seconds": time.monotonic() - begun,
            "command": ".venv/bin/python -m bench.bench_servers", "flags_both": COMMON_FLAGS,
            "scratch_parent": args.scratch_parent or tempfile.gettempdir(),
            "file_create_ms": file_create_ms(args.scratch_parent), "sandbox_cost": ours_raw["sandbox_cost"]}
    intervals = [run["mean_sample_interval_ms"] for runs in ours_raw["rss_detail"].values() for run in runs]
    info["sample_interval_ms"] = {kind: statistics.mean(i[kind] for i in intervals) for kind in ("rss", "pss")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({**info, "clients": rows_by_client, "memory_detail": ours_raw["rss_detail"]}, f, indent=2)
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write(results_markdown(rows_by_client, info))
    if importlib.util.find_spec("matplotlib") is None:  # the `bench` extra: the tables stand without it
        progress("results.png left as it is: matplotlib is missing (pip install -e '.[bench]')")
    else:
        draw_chart(rows_by_client, os.path.join(args.out, "results.png"), info["date"])


def print_sandbox_rows(args):
    """--sandbox-only: the sandboxed trivial row and the sandbox's cost, without the other scenarios."""
    scratch = tempfile.mkdtemp(prefix="kcoral-bench-", dir=args.scratch_parent)
    ours = Server("ours", lambda port: [sys.executable, "-m", "kcoral", "--port", str(port), "--device", "cpu",
                                        "--log-dir", "", "--sandbox", "none",
                                        "--disk-cache-dir", os.path.join(scratch, "ours-cache"),
                                        *COMMON_FLAGS], scratch)
    try:
        ours.wait_ready()
        trivial, cost = scenario_sandbox(ours, scratch, args.counts["trivial"], args.counts["burst"])
    finally:
        ours.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown_table(evaluate({"trivial_sandboxed": trivial})))
    print()
    print(sandbox_cost_table(cost))


if __name__ == "__main__":
    main()
