"""docs/kcoral-alerts.yml under `promtool test rules`: every alert fires on the failure it is for,
and none fires on an idle cohort or a healthy busy one.  The input series are shaped as our nodes
expose them: every answer's and ERROR event's counter present at 0 from the start (kcoral.ANSWERS,
kcoral.ALERTED_EVENTS), cumulative histogram buckets."""

import json
import os
import re
import shutil
import subprocess

import pytest

import kcoral
from tests.support import ROOT

RULES = os.path.join(ROOT, "docs", "kcoral-alerts.yml")
NODE = 'job="kcoral",instance="10.0.0.11:8000"'
MINUTES = 60  # samples of each series, one a minute (the test's interval)

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) missing")


PROXY = 'job="haproxy",instance="10.0.0.1:8404"'  # HAProxy's exporter (haproxy-config --stats-listen)


def series(name, labels, values, target=NODE):
    return {"series": f"{name}{{{target}{',' if labels else ''}{labels}}}", "values": values}


def proxy_series(name, labels, values):
    return series(name, labels, values, PROXY)


def proxy(requests_per_minute, errors_per_minute=0, denied_per_minute=0, down=()):
    """HAProxy's exporter for a cohort of three nodes: its frontend's requests, 5xx answers and 429s
    (denied), each node's state in kcoral_spread (`down`: those DOWN) and the nodes in service."""
    nodes = ("10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000")
    rows = [proxy_series("haproxy_frontend_http_requests_total", 'proxy="kcoral"', f"0+{requests_per_minute}x{MINUTES}"),
            proxy_series("haproxy_frontend_http_responses_total", 'proxy="kcoral",code="5xx"',
                         f"0+{errors_per_minute}x{MINUTES}"),
            proxy_series("haproxy_frontend_requests_denied_total", 'proxy="kcoral"', f"0+{denied_per_minute}x{MINUTES}"),
            proxy_series("haproxy_backend_active_servers", 'proxy="kcoral_spread"', f"{len(nodes) - len(down)}x{MINUTES}")]
    rows += [proxy_series("haproxy_server_status", f'proxy="kcoral_spread",server="{node}",state="{state}"',
                          f"{int((node in down) == (state == 'DOWN'))}x{MINUTES}")
             for node in nodes for state in ("UP", "DOWN")]
    return rows


def requests(status, code, kind, values):
    return series("kcoral_requests_total", f'status="{status}",code="{code}",kind="{kind}"', values)


def queue_histogram(per_minute, seconds):
    """kcoral_request_queue_seconds as a node exposes it: `per_minute` requests a minute, each having
    waited `seconds` (cumulative buckets: every bound at or above it counts them)."""
    bounds = [f"{b:g}" for b in kcoral.DURATION_BUCKETS] + ["+Inf"]
    rows = [series("kcoral_request_queue_seconds_bucket", f'le="{le}"',
                   f"0+{per_minute}x{MINUTES}" if le == "+Inf" or float(le) >= seconds else f"0x{MINUTES}")
            for le in bounds]
    return rows + [series("kcoral_request_queue_seconds_count", "", f"0+{per_minute}x{MINUTES}"),
                   series("kcoral_request_queue_seconds_sum", "", f"0+{per_minute * seconds:g}x{MINUTES}")]


def idle_node():
    """Up, taking work, every counter at 0, as a node that has answered nothing yet."""
    return ([series("up", "", f"1x{MINUTES}"), series("kcoral_capacity", "", f"2x{MINUTES}"),
             series("kcoral_worker_crashes_total", "", f"0x{MINUTES}")]
            + [requests(*answer, f"0x{MINUTES}") for answer in kcoral.ANSWERS]
            + [series("kcoral_events_total", f'event="{e}",level="ERROR"', f"0x{MINUTES}")
               for e in kcoral.ALERTED_EVENTS]
            + queue_histogram(0, 0) + proxy(0))


def healthy_node():
    """Busy and well: 40 answers a minute (a few FAILED programs, a few 503s a proxy retried, a
    program's 504), queue waits of 2 s, a fresh worker per request and a crash now and then."""
    rows = [row for row in idle_node() if not row["series"].startswith(("kcoral_requests_total",
                                                                         "kcoral_request_queue",
                                                                         "kcoral_worker_crashes", "haproxy_"))]
    busy = {("COMPLETED", "200", ""): 30, ("FAILED", "200", "runtime"): 5, ("ERROR", "503", "busy"): 4,
            ("ERROR", "504", "timeout"): 1}
    rows += [requests(*answer, f"0+{busy.get(answer, 0)}x{MINUTES}") for answer in kcoral.ANSWERS]
    rows += [series("kcoral_worker_crashes_total", "", f"0x30 1x{MINUTES - 30}")]
    # the proxy: 120 requests a minute over the cohort, one 5xx and one 429 now and then
    return rows + queue_histogram(40, 2) + proxy(120, errors_per_minute=1, denied_per_minute=1)


def replaced(rows, *new):
    """`rows` with the series of `new` in place of those of the same name and labels."""
    names = {row["series"] for row in new}
    return [row for row in rows if row["series"] not in names] + list(new)


NODE_LABELS = {"job": "kcoral", "instance": "10.0.0.11:8000"}
# alert -> (the failure it is for, as input series; when it must be firing; the labels it then carries)
FAILURES = {
    "KCoralNodeDown": (replaced(idle_node(), series("up", "", f"1x10 0x{MINUTES - 10}")), "20m", NODE_LABELS),
    "KCoralNodeDraining": (replaced(idle_node(), series("kcoral_capacity", "", f"2x10 0x{MINUTES - 10}")), "30m",
                           NODE_LABELS),
    # a ratio: 6 of 46 answers a minute (the 503s it counts apart, the 504 in 40 it tolerates)
    "KCoralServerErrors": (replaced(healthy_node(), requests("ERROR", "500", "engine", f"0+6x{MINUTES}")), "20m",
                           {"instance": NODE_LABELS["instance"]}),
    "KCoralQueueBacklog": (replaced(healthy_node(), *queue_histogram(40, 60)), "30m", {}),  # cohort-wide
    "KCoralWorkersCrashing": (replaced(healthy_node(), series("kcoral_worker_crashes_total", "",
                                                              f"0x10 0+2x{MINUTES - 10}")), "25m", NODE_LABELS),
    "KCoralErrorEvent": (replaced(idle_node(), series("kcoral_events_total", 'event="tokens_reload_failed",level="ERROR"',
                                                      f"0x20 1x{MINUTES - 20}")), "25m",
                         {"instance": NODE_LABELS["instance"], "event": "tokens_reload_failed"}),
    "KCoralProxyNodeDown": (replaced(healthy_node(), *proxy(120, down=("10.0.0.12:8000",))), "5m",
                            {"job": "haproxy", "instance": "10.0.0.1:8404", "proxy": "kcoral_spread",
                             "server": "10.0.0.12:8000", "state": "DOWN"}),
    "KCoralProxyNoNode": (replaced(healthy_node(), *proxy(0, down=("10.0.0.11:8000", "10.0.0.12:8000",
                                                                    "10.0.0.13:8000"))), "5m",
                          {"job": "haproxy", "instance": "10.0.0.1:8404", "proxy": "kcoral_spread"}),
    "KCoralProxyErrors": (replaced(healthy_node(), *proxy(120, errors_per_minute=12)), "20m",
                          {"instance": "10.0.0.1:8404"}),
    "KCoralProxyRateLimited": (replaced(healthy_node(), *proxy(120, denied_per_minute=30)), "20m",
                               {"instance": "10.0.0.1:8404"}),
    "KCoralGpuQuarantined": (replaced(idle_node(), series("kcoral_events_total",
                                                          'event="gpu_quarantined",level="ERROR"',
                                                          f"0x20 1x{MINUTES - 20}")), "25m",
                             {**NODE_LABELS, "event": "gpu_quarantined", "level": "ERROR"}),
}


def alert_names():
    with open(RULES) as f:
        return re.findall(r"^\s*- alert: (\w+)$", f.read(), re.M)


def rule_text(name):
    with open(RULES) as f:
        return f.read().split(f"- alert: {name}\n")[1].split("- alert:")[0]


def annotations(name, labels):
    """The alert's summary as the rule file templates it, for these labels, and its runbook link."""
    rule = rule_text(name)
    text = re.search(r'summary: "(.*)"', rule)[1]
    return {"summary": re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], text),
            "runbook_url": re.search(r'runbook_url: "(.*)"', rule)[1]}


def severity(name):
    return re.search(r"severity: (\w+)", rule_text(name))[1]


def test_every_alert_has_a_severity_and_a_runbook_that_exists():
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        headings = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                    for line in f if line.startswith("#")}
    for name in alert_names():
        assert severity(name) in ("critical", "warning"), name
        url = re.search(r'runbook_url: "(.*)"', rule_text(name))[1]
        assert url.startswith("file:///opt/kcoral/docs/operations.md#"), url
        assert url.split("#")[1] in headings, (name, url)


def test_every_alert_has_its_failure_case():
    assert sorted(FAILURES) == sorted(alert_names())


def test_promtool_alert_tests(tmp_path):
    """Each alert fires on its failure, and is silent on an idle node and on a healthy busy one
    throughout the hour."""
    tests = []
    for name, (rows, when, labels) in FAILURES.items():
        tests.append({"name": f"{name} fires on its failure", "interval": "1m", "input_series": rows,
                      "alert_rule_test": [{"eval_time": when, "alertname": name,
                                           "exp_alerts": [{"exp_labels": {**labels, "severity": severity(name)},
                                                          "exp_annotations": annotations(name, labels)}]}]})
    for scenario, rows in (("idle", idle_node()), ("healthy", healthy_node())):
        tests.append({"name": f"nothing fires on a {scenario} node", "interval": "1m", "input_series": rows,
                      "alert_rule_test": [{"eval_time": f"{m}m", "alertname": name, "exp_alerts": []}
                                          for name in FAILURES for m in (1, 10, 30, MINUTES - 1)]})
    path = tmp_path / "alerts-test.yml"
    path.write_text(json.dumps({"rule_files": [RULES], "evaluation_interval": "1m", "tests": tests}))  # JSON is YAML
    checked = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr

