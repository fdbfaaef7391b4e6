"""`ascendserve status` without a network: urllib's urlopen answers from a table, with the bodies the
real proxy and metaserver types produce (router/pools.Instance.summary, router/metrics.ProxyMetrics,
protocol/registry.RegistryView), so a renamed field shows here."""

from __future__ import annotations

import base64
import io
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import msgspec
import pytest

from ascendserve.protocol.registry import InstanceView, Load, Registration, RegistryView
from ascendserve.router.metrics import ProxyMetrics
from ascendserve.router.pools import Pools
from ascendserve.status import command
from ascendserve.status.snapshot import Row, Snapshot
from ascendserve.status.table import render, use_colour

PROXY = "http://proxy.test:8000"
META = "http://meta.test:9000"
TOKEN = "sekret-token"


class Answer:
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    def read(self) -> bytes:
        return self.body

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeNet:
    """urlopen answering from {url: (status, body) | exception}; 401 unless the token is right
    where `guarded`; records every request's headers."""

    def __init__(self, routes: dict, guarded=(), token: str = TOKEN):
        self.routes, self.guarded, self.token = routes, set(guarded), token
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, request, timeout=None, context=None):
        url = request.full_url if isinstance(request, urllib.request.Request) else request
        headers = {k.lower(): v for k, v in request.header_items()}
        self.seen.append((url, headers))
        if url in self.guarded and headers.get("authorization") != f"Bearer {self.token}":
            raise urllib.error.HTTPError(url, 401, "Unauthorized", {}, io.BytesIO(b'{"error": {}}'))
        answer = self.routes.get(url, urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")))
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        if status >= 400:
            raise urllib.error.HTTPError(url, status, "error", {}, io.BytesIO(body))
        return Answer(status, body)


def proxy_instances() -> dict:
    """What the proxy's GET /instances answers, from its own Pools (scrambled order)."""
    pools = Pools()
    specs = [("pd", "http://h:8004", "active"), ("decode", "http://h:8003", "ejected"),
             ("decode", "http://h:8002", "active"), ("prefill", "http://h:8001", "active"),
             ("encoder", "http://h:8000", "probing")]
    for role, url, state in specs:
        inst = pools[role].add(url, source="registry", instance_id=f"{role}-{url[-4:]}")
        inst.state = state
    p = pools["prefill"].instances["http://h:8001"]
    p.active_requests, p.active_kv, p.kv_usage, p.served, p.others = 3, 17, 0.375, 40, 2
    bad = pools["decode"].instances["http://h:8003"]
    bad.failures, bad.last_error = 4, "GET http://h:8003/health: connect failed:\n" + "x" * 200
    return {"instances": [i.summary() for i in pools.all_instances()]}


def proxy_metrics() -> bytes:
    m = ProxyMetrics(Pools())
    m.requests.labels("chat", "200").inc(5)
    m.requests.labels("completions", "200").inc(2)
    m.requests.labels("chat", "503").inc(1)
    m.retries.labels("decode").inc(3)
    m.migrations.labels("decode", "connection").inc(1)
    return m.render()


def proxy_routes(health=(200, {"status": "ok", "roles": {}})) -> dict:
    return {PROXY + "/health": health, PROXY + "/instances": (200, proxy_instances()),
            PROXY + "/metrics": (200, proxy_metrics())}


def run(monkeypatch, argv, net: FakeNet, env=None, out=None, sleep=None) -> tuple[int, str]:
    monkeypatch.setattr(urllib.request, "urlopen", net)
    out = out or io.StringIO()
    code = command.main(argv, {} if env is None else env, out, sleep or (lambda s: None))
    return code, out.getvalue()


def usage(monkeypatch, argv, env=None) -> int:
    def sleep(seconds):
        raise AssertionError(f"a usage error must stop before the first round (slept {seconds})")

    try:
        return run(monkeypatch, argv, FakeNet({}), env, sleep=sleep)[0]
    except SystemExit as exc:  # argparse's own usage errors
        return exc.code


def test_proxy_table_has_a_row_per_instance_in_role_order(monkeypatch):
    code, text = run(monkeypatch, ["--proxy", PROXY], FakeNet(proxy_routes(), [PROXY + "/instances"]),
                     {"ASCENDSERVE_CLUSTER_TOKEN": TOKEN})
    assert code == 0
    lines = text.splitlines()
    assert "READY" in lines[0] and PROXY in lines[0]
    assert "5 instance(s), 3 healthy" in lines[1] and "requests 8 (1 failed)" in lines[1]
    assert "retries 3" in lines[1] and "migrations 1" in lines[1] and "in flight 3" in lines[1]
    header, rows = lines[2], lines[3:]
    assert header.split() == ["ROLE", "URL", "ID", "STATE", "IN", "FLIGHT", "OTHERS", "KV", "USE", "KV", "FOR", "D",
                              "SERVED", "FAILS", "LAST", "ERROR"]
    assert [(r.split()[0], r.split()[1], r.split()[3]) for r in rows] == [
        ("encoder", "http://h:8000", "probing"), ("prefill", "http://h:8001", "active"),
        ("decode", "http://h:8002", "active"), ("decode", "http://h:8003", "ejected"), ("pd", "http://h:8004", "active")]
    prefill = rows[1].split()
    assert prefill[4:10] == ["3", "2", "38%", "17", "40", "0"]
    assert rows[2].split()[7] == "-", "KV held for decode: prefill only"
    error = rows[3].split(None, 10)[10]
    assert error.startswith("GET /health: connect failed: xxx") and error.endswith("...") and len(error) == 60
    assert "\033" not in text, "no colour into a StringIO"


def test_json_is_one_document_with_pinned_fields(monkeypatch):
    code, text = run(monkeypatch, ["--proxy", PROXY, "--json"], FakeNet(proxy_routes()))
    assert code == 0 and len(text.splitlines()) == 1
    doc = json.loads(text)
    assert sorted(doc) == ["error", "instances", "missing", "push_pending", "ready", "source", "time", "totals",
                           "where"]
    assert doc["source"] == "proxy" and doc["ready"] is True and doc["error"] is None
    assert doc["totals"] == {"requests": 8, "failed": 1, "retries": 3, "migrations": 1, "encoder_fallbacks": 0,
                             "client_disconnects": 0}
    assert sorted(doc["instances"][0]) == sorted(
        ["role", "url", "instance_id", "state", "healthy", "in_flight", "others", "kv_usage", "kv_held", "served",
         "failures", "last_error", "model", "running", "waiting", "age_s"])
    assert [(i["role"], i["healthy"]) for i in doc["instances"]] == [
        ("encoder", False), ("prefill", True), ("decode", True), ("decode", False), ("pd", True)]


def test_engine_load_is_unknown_for_instances_the_proxy_was_given_by_flag(monkeypatch):
    pools = Pools()
    pools["pd"].add("http://h:1", source="static").state = "active"
    routes = {**proxy_routes(), PROXY + "/instances": (200, {"instances": [i.summary() for i in pools.all_instances()]})}
    code, text = run(monkeypatch, ["--proxy", PROXY, "--json"], FakeNet(routes))
    row = json.loads(text)["instances"][0]
    assert code == 0 and row["kv_usage"] is None and row["others"] is None and row["in_flight"] == 0
    code, text = run(monkeypatch, ["--proxy", PROXY], FakeNet(routes))
    assert text.splitlines()[-1].split()[3:8] == ["active", "0", "-", "-", "-"]


def test_not_ready_says_what_is_missing_and_exits_1(monkeypatch):
    missing = "no healthy decode instance: 2 registered, 2 ejected"
    routes = proxy_routes((503, {"status": "degraded", "missing": [missing], "error": {"message": missing}}))
    code, text = run(monkeypatch, ["--proxy", PROXY], FakeNet(routes))
    assert code == 1 and "NOT READY: " + missing in text.splitlines()[0]
    code, text = run(monkeypatch, ["--proxy", PROXY, "--json"], FakeNet(routes))
    assert code == 1 and json.loads(text)["missing"] == [missing]


@pytest.mark.parametrize("reason,needle", [
    (ConnectionRefusedError(111, "Connection refused"), "connection refused (nothing listens there)"),
    (TimeoutError("timed out"), "no answer (timed out)"),
    (ssl.SSLCertVerificationError(1, "certificate verify failed"), "pass --tls-ca"),
])
def test_unreachable_is_exit_1_with_the_reason(monkeypatch, capsys, reason, needle):
    net = FakeNet({PROXY + "/health": urllib.error.URLError(reason)})
    code, text = run(monkeypatch, ["--proxy", PROXY], net)
    assert code == 1 and "UNREACHABLE" in text and needle in text and f"{PROXY}/health" in text
    code, text = run(monkeypatch, ["--proxy", PROXY, "--json"], net)
    assert code == 1 and needle in json.loads(text)["error"] and needle in capsys.readouterr().err


def test_the_wrong_kind_of_server_says_so(monkeypatch):
    # a metaserver's URL given as --proxy: /health answers, /instances is not there
    routes = {PROXY + "/health": (200, {"status": "ok", "instances": {}, "push_pending": 0}),
              PROXY + "/instances": (404, {"error": {"message": "Not Found"}})}
    code, text = run(monkeypatch, ["--proxy", PROXY], FakeNet(routes))
    assert code == 1 and "/instances answered 404" in text and "the right kind of server" in text


def test_the_token_goes_only_to_guarded_routes_and_a_file_wins(monkeypatch, tmp_path):
    net = FakeNet(proxy_routes(), [PROXY + "/instances"])
    assert run(monkeypatch, ["--proxy", PROXY], net, {"ASCENDSERVE_CLUSTER_TOKEN": TOKEN})[0] == 0
    sent = {url: h.get("authorization") for url, h in net.seen}
    assert sent == {PROXY + "/health": None, PROXY + "/instances": f"Bearer {TOKEN}", PROXY + "/metrics": None}
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    net.seen.clear()
    code, _ = run(monkeypatch, ["--proxy", PROXY, "--token-file", str(path)], net,
                  {"ASCENDSERVE_CLUSTER_TOKEN": "stale"})
    assert code == 0 and dict(net.seen)[PROXY + "/instances"]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.parametrize("how,needle", [
    ("none", "none was given; set ASCENDSERVE_CLUSTER_TOKEN or pass --token-file FILE"),
    ("env", "the cluster token from $ASCENDSERVE_CLUSTER_TOKEN was refused"),
    ("file", "the cluster token from --token-file"),
])
def test_a_refused_token_says_where_it_came_from_and_exits_2(monkeypatch, capsys, tmp_path, how, needle):
    (tmp_path / "t").write_text("wrong")
    env = {"ASCENDSERVE_CLUSTER_TOKEN": "wrong"} if how == "env" else {}
    argv = ["--proxy", PROXY] + (["--token-file", str(tmp_path / "t")] if how == "file" else [])
    code, _ = run(monkeypatch, argv, FakeNet(proxy_routes(), [PROXY + "/instances"]), env)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "401" in err and "wrong" not in err.replace(str(tmp_path), "")


@pytest.mark.parametrize("argv,env", [
    ([], {}),
    (["--proxy", PROXY, "--metaserver", META], {}),
    (["--proxy", PROXY, "--watch", "0"], {}),
    (["--proxy", "ftp://x"], {}),
    (["--proxy", PROXY, "--cluster", "c1"], {}),
    (["--proxy", PROXY, "--token-file", "/nonexistent/token"], {}),
    (["--proxy", PROXY, "--tls-ca", "/nonexistent/ca.pem"], {}),
    (["--etcd", "http://e:2379", "--cluster", "a/b"], {}),
    (["--etcd", "http://e:2379"], {"ASCENDSERVE_REGISTRY_PASSWORD": "pw"}),
])
def test_usage_errors_exit_2(monkeypatch, argv, env):
    assert usage(monkeypatch, argv, env) == 2


def test_token_is_no_abbreviation_of_token_file(monkeypatch, tmp_path):
    (tmp_path / "t").write_text(TOKEN)
    assert usage(monkeypatch, ["--proxy", PROXY, "--token", str(tmp_path / "t")]) == 2


def test_an_empty_token_file_is_a_usage_error(monkeypatch, tmp_path, capsys):
    (tmp_path / "t").write_text("\n")
    assert usage(monkeypatch, ["--proxy", PROXY, "--token-file", str(tmp_path / "t")]) == 2
    assert "is empty" in capsys.readouterr().err


def test_colour_on_a_terminal_only():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert use_colour(Tty(), {}) and not use_colour(io.StringIO(), {})
    assert not use_colour(Tty(), {"NO_COLOR": "1"}) and not use_colour(Tty(), {"TERM": "dumb"})
    assert use_colour(Tty(), {"NO_COLOR": ""}), "no-color.org: an empty NO_COLOR does not count"
    snap = Snapshot("proxy", PROXY, ready=True, rows=[Row("decode", "http://d", state="active"),
                                                      Row("decode", "http://e", state="ejected", last_error="boom")])
    coloured, plain = render(snap, colour=True), render(snap, colour=False)
    assert "\033[32mactive" in coloured and "\033[31mejected" in coloured and "\033[32mREADY" in coloured
    assert "\033" not in plain
    strip = __import__("re").compile(r"\033\[[0-9;]*m")
    assert strip.sub("", coloured) == plain, "colour changes no text or alignment"


def test_watch_redraws_until_ctrl_c_which_exits_0(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    rounds = []

    def sleep(seconds):
        rounds.append(seconds)
        if len(rounds) == 3:
            raise KeyboardInterrupt

    # a cluster down at first, then up: the watch keeps going through the error
    net = FakeNet(proxy_routes())
    first = {PROXY + "/health": urllib.error.URLError(ConnectionRefusedError(111, "refused"))}
    calls = {"n": 0}

    def flaky(request, timeout=None, context=None):
        calls["n"] += 1
        return FakeNet(first)(request) if calls["n"] == 1 else net(request)

    code, text = run(monkeypatch, ["--proxy", PROXY, "--watch", "--json"], flaky, sleep=sleep)
    docs = [json.loads(line) for line in text.splitlines()]
    assert code == 0 and rounds == [2.0, 2.0, 2.0] and len(docs) == 3
    assert docs[0]["error"] and docs[1]["ready"] and docs[2]["ready"]
    rounds.clear()
    code, text = run(monkeypatch, ["--proxy", PROXY, "--watch", "0.5"], net, sleep=sleep)
    assert code == 0 and rounds == [0.5] * 3 and text.count("READY") == 3 and command.CLEAR not in text
    rounds.clear()
    code, text = run(monkeypatch, ["--proxy", PROXY, "--watch"], net, out=Tty(), sleep=sleep,
                     env={"NO_COLOR": "1"})
    assert code == 0 and text.count(command.CLEAR) == 3 and text.startswith(command.CLEAR)
    assert "\033[3" not in text, "NO_COLOR: clearing the screen, no colour"


def test_metaserver_rows_from_the_registry_view(monkeypatch):
    def view(*roles):
        return RegistryView(revision=3, heartbeat_timeout_s=10.0, instances=[
            InstanceView(instance_id=f"{r}-1", role=r, url=f"http://h:{8000 + n}", model="m", version="v",
                         load=Load(running=n, waiting=1, kv_usage=0.5), age_s=75.0 * (n + 1))
            for n, r in enumerate(roles)])

    for roles, ready in ((("decode", "elastic-server", "prefill"), True), (("prefill",), False)):
        routes = {META + "/health": (200, {"status": "ok", "instances": {}, "revision": 3, "push_pending": 2}),
                  META + "/v1/registry/instances": (200, msgspec.json.encode(view(*roles)))}
        code, text = run(monkeypatch, ["--metaserver", META], FakeNet(routes, [META + "/v1/registry/instances"]),
                         {"ASCENDSERVE_CLUSTER_TOKEN": TOKEN})
        lines = text.splitlines()
        assert code == (0 if ready else 1)
        if ready:
            assert "push pending 2" in lines[1]
            assert lines[2].split() == ["ROLE", "URL", "ID", "STATE", "MODEL", "RUNNING", "WAITING", "KV", "USE",
                                        "AGE"]
            assert [r.split()[0] for r in lines[3:]] == ["prefill", "decode", "elastic-server"]
            assert lines[3].split()[3:] == ["registered", "m", "2", "1", "50%", "4m"]
        else:
            assert "NOT READY: no decode instance registered" in lines[0]


def test_etcd_rows_from_the_registrations(monkeypatch):
    regs = [Registration(instance_id="p1", role="prefill", url="http://h:1", model="m",
                         load=Load(running=2, waiting=0, kv_usage=0.1)),
            Registration(instance_id="d1", role="decode", url="http://h:2", model="m")]
    kvs = [{"key": base64.b64encode(f"/ascendserve/c1/instances/{r.instance_id}".encode()).decode(),
            "value": base64.b64encode(msgspec.json.encode(r)).decode()} for r in regs]
    kvs.append({"key": base64.b64encode(b"/ascendserve/c1/instances/junk").decode(),
                "value": base64.b64encode(b"not json").decode()})
    asked = []

    def etcd(request, timeout=None, context=None):
        asked.append((request.full_url, json.loads(request.data)))
        if request.full_url.endswith("/v3/kv/range"):
            return Answer(200, json.dumps({"header": {"revision": "9"}, "kvs": kvs}).encode())
        raise urllib.error.URLError(ConnectionRefusedError(111, "refused"))

    code, text = run(monkeypatch, ["--etcd", "http://e:2379", "--cluster", "c1", "--json"], etcd)
    doc = json.loads(text)
    assert code == 0 and doc["source"] == "etcd" and "cluster c1" in doc["where"]
    assert [(i["role"], i["url"], i["running"], i["state"]) for i in doc["instances"]] == [
        ("prefill", "http://h:1", 2, "registered"), ("decode", "http://h:2", 0, "registered")]
    assert base64.b64decode(asked[0][1]["key"]) == b"/ascendserve/c1/instances/"

    def refused(request, timeout=None, context=None):
        raise urllib.error.HTTPError(request.full_url, 400, "Bad Request", {},
                                     io.BytesIO(b'{"message": "etcdserver: authentication failed, invalid user ID '
                                                b'or password"}'))

    code, _ = run(monkeypatch, ["--etcd", "http://e:2379", "--registry-username", "u"], refused,
                  {"ASCENDSERVE_REGISTRY_PASSWORD": "pw"})
    assert code == 2
    code, text = run(monkeypatch, ["--etcd", "http://e:2379"], FakeNet({}))
    assert code == 1 and "UNREACHABLE" in text and "no etcd endpoint answered" in text


def test_status_is_a_cli_command_that_imports_no_engine():
    code = ("import sys\nfrom ascendserve.cli import main\n"
            "try:\n    main(['status', '--proxy', 'http://127.0.0.1:1', '--timeout', '1'])\n"
            "except SystemExit as e:\n    print('EXIT', e.code)\n"
            "print('HEAVY', [m for m in ('torch', 'vllm', 'transformers', 'litestar') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "EXIT 1" in r.stdout and "HEAVY []" in r.stdout, r.stdout + r.stderr
    assert "connection refused" in r.stdout
    helped = subprocess.run([sys.executable, "-m", "ascendserve", "--help"], capture_output=True, text=True, timeout=60)
    assert "status --proxy URL" in helped.stdout
    own = subprocess.run([sys.executable, "-m", "ascendserve", "status", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert own.returncode == 0 and all(f in own.stdout for f in ("--proxy", "--metaserver", "--etcd", "--watch",
                                                                 "--json", "--token-file", "--tls-ca"))
