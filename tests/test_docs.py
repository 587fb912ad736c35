"""Statements of the reference docs checked against the code and a real server, so that they
cannot drift: the event log's table (docs/server.md §10), the references a `run` resolves
(docs/client.md §3.8), the names docs/design.md cites and the worker's message table."""

import ast
import os
import re
import signal

import pytest

from kcoral import Client, KCoralError, Program
from tests.support import (
    ROOT,
    ServerProcess,
    bound_names,
    documented_log_events,
    log_records,
    one_call,
    request,
    run_directories,
    wait_for,
)

SERVER_DOC = os.path.join(ROOT, "docs", "server.md")
RECORD_KEYS = {"timestamp", "level", "event"}


def test_the_table_lists_every_event_the_server_logs():
    with open(os.path.join(ROOT, "kcoral.py"), encoding="utf-8") as f:
        logged = set(re.findall(r"\.event\(\s*\"(\w+)\"", f.read()))
    assert len(logged) > 15
    assert set(documented_log_events(SERVER_DOC)) == logged


def test_a_real_log_has_exactly_the_documented_fields(tmp_path):
    """ok, failed, invalid (400) and refused (401) requests, a SIGHUP and a shutdown: every
    record written has its event's documented level and fields, all of them and no others."""
    token_file = tmp_path / "tokens"
    token_file.write_text("doc-token\n")
    token_file.chmod(0o600)
    auth = {"Authorization": "Bearer doc-token"}
    log_dir = tmp_path / "logs"
    srv = ServerProcess("--log-dir", str(log_dir), "--token-file", str(token_file), workers=1, tmp_path=tmp_path)
    try:
        with Client(srv.url, headers=auth) as client:
            assert client.execute(one_call("def f():\n    return 1\n")).completed
            assert client.execute(one_call("def f():\n    raise ValueError('no')\n")).error["kind"] == "engine"
            with pytest.raises(KCoralError) as invalid:  # no instructions: answered 400, so request_finished
                client.execute(Program())
            assert invalid.value.status_code == 400
        assert request("GET", srv.url + "/health")[0] == 401  # no token: refused
        (run_dir,) = run_directories(log_dir)
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: any(r["event"] == "tokens_reloaded" for r in log_records(run_dir)))
    finally:
        assert srv.stop() == 0
    records = log_records(run_dir)
    documented = documented_log_events(SERVER_DOC)
    for record in records:
        levels, fields, optional = documented[record["event"]]
        assert record["level"] in levels, record
        assert fields <= set(record) - RECORD_KEYS <= fields | optional, record
    seen = {record["event"] for record in records}
    assert {"server_started", "request_finished", "request_refused", "log_reopened", "tokens_reloaded",
            "shutdown_started", "server_stopped"} <= seen
    finished = [r for r in records if r["event"] == "request_finished"]
    assert sorted((r["http_status"], r["status"]) for r in finished) == [(200, "COMPLETED"), (200, "FAILED"),
                                                                       (400, "ERROR")]
    assert any(r["request_id"] == "" and r["http_status"] == 401 for r in records if r["event"] == "request_refused")


def test_only_top_level_references_are_resolved(tmp_path):
    """A reference-shaped object nested in an argument is a literal, known id or not; a top-level
    one naming no handle is a 400."""
    nested = [[{"$ref": "m"}], {"a": {"$ref": "nowhere"}}]
    with ServerProcess(workers=1, tmp_path=tmp_path) as srv, Client(srv.url) as client:
        program = Program()
        module = program.upload(id="m", kind="module", source="def f(*args):\n    return list(args)\n")
        echo = program.get_function(module=module, name="f")
        program.return_(key="out", value=program.run(fn=echo, args=nested))
        assert client.execute(program)["out"] == nested
        unknown = Program()
        f = unknown.get_function(module=unknown.upload(kind="module", source="def f(x):\n    return x\n"), name="f")
        unknown.run(fn=f, args=[{"$ref": "nowhere"}])
        with pytest.raises(KCoralError) as refused:
            client.execute(unknown)
    assert refused.value.status_code == 400 and "nowhere" in refused.value.message


def cited_names(path):
    """The code names a document cites in backticks: `Name`, `Class.method`, `module.name`, `call()`;
    flags, paths, literals and prose in backticks are not names."""
    with open(path, encoding="utf-8") as f:
        quoted = re.findall(r"`([^`\n]+)`", f.read())
    names = set()
    for text in quoted:
        text = text.removesuffix("()")
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", text) and (
                "_" in text or "." in text or re.search(r"[a-z][A-Z]", text)):
            names.add(text)
    return names


def defined_names(paths):
    """Every `name`, `module.name` and `Class.attribute` the files define: their top-level functions,
    classes and assignments, and each class's methods, class attributes and `self.` attributes."""
    defined = set()
    for path in paths:
        module = os.path.splitext(os.path.basename(path))[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            for name in bound_names(node):
                defined.update({name, f"{module}.{name}"})
            if isinstance(node, ast.ClassDef):
                defined.update(f"{node.name}.{member}" for member in class_members(node))
    return defined


def class_members(cls):
    members = [name for node in cls.body for name in bound_names(node)]
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            members.append(node.attr)
    return members


def test_the_design_note_cites_only_names_the_code_has():
    """A plain name must occur in the code (it may be a setting or a message's field); a dotted one
    must be defined where it says: `Pool.replace` is a member of the class Pool, not a `replace`
    anywhere beside a `Pool` anywhere."""
    paths = [os.path.join(ROOT, name) for name in ("kcoral.py", "kcoral_worker.py", "client.py")]
    sources = ""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            sources += f.read()
    defined = defined_names(paths)
    cited = cited_names(os.path.join(ROOT, "docs", "design.md"))
    assert len(cited) > 40, cited
    files = {name for name in cited if os.path.isfile(os.path.join(ROOT, name))}
    missing = sorted(n for n in cited - files
                     if n not in defined and ("." in n or not re.search(rf"\b{re.escape(n)}\b", sources)))
    assert not missing, f"docs/design.md cites names the code does not have where it says: {missing}"


def test_the_worker_message_table_lists_every_message_type():
    import kcoral_worker
    table = kcoral_worker.__doc__.split("Payloads travel raw.")[0]
    listed = set(re.findall(r"\b[A-Z][a-z]+[A-Z]\w*\b", table))
    assert len(kcoral_worker.MESSAGE_TYPES) >= 20
    assert set(kcoral_worker.MESSAGE_TYPES) == listed, (
        f"missing from the table: {sorted(set(kcoral_worker.MESSAGE_TYPES) - listed)}; "
        f"listed but no message: {sorted(listed - set(kcoral_worker.MESSAGE_TYPES))}")


VERBS = ("start", "drain", "refuse_waiters", "stop", "kill", "halt", "close")


def glossary_classes():
    """{verb: the classes kcoral.py's docstring lists for it}."""
    import kcoral
    glossary = kcoral.__doc__.split("Lifecycle verbs mean one thing each")[1].split("\n\n")[0]
    clauses = re.findall(rf"`({'|'.join(VERBS)})` ([^;]*)", glossary)
    return {verb: set(re.findall(r"`(\w+)`", text)) for verb, text in clauses}


def verb_methods():
    """{verb: {class name: its method of that name}} over kcoral.py."""
    with open(os.path.join(ROOT, "kcoral.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    methods = {verb: {} for verb in VERBS}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name in methods:
                    methods[method.name][node.name] = method
    return methods


def test_each_lifecycle_verb_means_what_the_glossary_says():
    """kcoral.py's docstring lists, for each lifecycle verb, the classes that have a method of that
    name; a class with another such method gives the verb a second meaning."""
    listed = glossary_classes()
    assert set(listed) == set(VERBS)
    assert {verb: set(classes) for verb, classes in verb_methods().items()} == listed


def called_names(function):
    """The names a function's body calls: `f()` -> f, `x.y.f()` -> f."""
    return {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            for node in ast.walk(function) if isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))}


def raised_flags(function):
    """The attributes a function sets true: `self.x = True`, `self.x = self.x or y`."""
    return {target.attr for node in ast.walk(function) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)
            and (isinstance(node.value, ast.Constant) and node.value.value is True
                 or isinstance(node.value, ast.BoolOp) and isinstance(node.value.op, ast.Or))}


SIGNALLING = {"kill", "killpg", "kill_group", "kill_requests", "terminate", "send_signal"}
ENDING = SIGNALLING | {"join", "wait", "stop", "shutdown", "close", "end_worker"}


def verb_breaches(verb, function):
    """What `function`, a method named `verb`, does that the glossary says the verb does not (or
    fails to do what it says), read from the calls in its body; [] when it keeps to the verb."""
    calls = called_names(function)
    if verb == "start":
        return [] if calls & {"start", "start_worker", "Popen", "fork"} else ["starts no thread or process"]
    if verb in ("drain", "refuse_waiters"):
        return [f"ends work: {sorted(calls & ENDING)}"] * bool(calls & ENDING) + \
            ["raises no flag that admits nothing new"] * (not raised_flags(function)) + \
            ["wakes no waiter"] * ("notify_all" not in calls)
    if verb == "stop":  # it may end processes by kill, but must wait for what it ends
        return [] if calls & {"join", "wait", "stop", "shutdown"} else ["waits for no thread or process to end"]
    if verb == "kill":
        return [] if calls & SIGNALLING else ["sends no signal"]
    if verb == "halt":  # a kill that waits for nothing
        return (["sends no signal"] * (not calls & SIGNALLING) +
                [f"waits: {sorted(calls & {'join', 'wait'})}"] * bool(calls & {"join", "wait"}))
    if verb == "close":
        return [f"does more than close: {sorted(calls - {'close'})}"] * bool(calls - {"close"})
    raise AssertionError(verb)


def test_each_lifecycle_method_does_what_its_verb_says():
    """Not only the names: a `start` starts a thread or process, a `drain` or `refuse_waiters`
    raises a flag and wakes the waiters without ending anything, a `stop` waits for what it
    ends, a `kill` signals, a `close` only closes."""
    methods = verb_methods()
    assert sum(map(len, methods.values())) >= 12
    breaches = {f"{cls}.{verb}": verb_breaches(verb, function)
                for verb, classes in methods.items() for cls, function in classes.items()}
    assert not {name: why for name, why in breaches.items() if why}


@pytest.mark.parametrize("verb, source, breach", [
    ("close", "def close(self):\n    self.flush()\n    os.close(self.fd)", "does more than close"),
    ("kill", "def kill(self):\n    self.conn.close()", "sends no signal"),
    ("stop", "def stop(self):\n    self.stopped.set()", "waits for no"),
    ("drain", "def drain(self):\n    self.closing = True\n    self.cond.notify_all()\n    self.worker.kill()", "ends work"),
    ("start", "def start(self):\n    self.ready = True", "starts no"),
    ("halt", "def halt(self):\n    os.killpg(self.pid, 9)\n    self.process.join()", "waits"),
])
def test_the_verb_check_finds_a_method_that_breaks_its_verb(verb, source, breach):
    (breaches,) = [verb_breaches(verb, ast.parse(source).body[0])]
    assert any(breach in why for why in breaches), breaches


def test_a_stopped_connection_guard_leaves_no_thread():
    import kcoral
    guard = kcoral.ConnectionGuard(kcoral.ServerConfig())
    assert guard.thread.is_alive()
    guard.stop()
    assert not guard.thread.is_alive()


def test_the_worker_docstring_names_every_module_level_name_it_changes():
    """Names rebound through `global`, and module-level dicts filled at run time (`name[...] = `
    inside a function), are what a worker changes of its module: the docstring lists them all.
    Decorators applied as the module is imported (`@message` filling MESSAGE_TYPES) change nothing
    afterwards."""
    path = os.path.join(ROOT, "kcoral_worker.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    module_level = {name for node in tree.body for name in bound_names(node)}
    decorators = {d.id for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))
                  for d in node.decorator_list if isinstance(d, ast.Name)}
    changed = set()
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name not in decorators):
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                changed.update(node.names)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in module_level:
                changed.add(node.value.id)
    import kcoral_worker
    listed = set(re.findall(r"`(\w+)`", kcoral_worker.__doc__.split("module-level names change in a worker")[1]
                            .split("Nothing else module-level changes")[0]))
    assert len(changed) >= 5
    assert changed == listed, f"changed but not listed: {changed - listed}; listed but not changed: {listed - changed}"
