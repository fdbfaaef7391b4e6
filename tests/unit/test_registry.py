from ascendserve.metaserver.registry import Registry
from ascendserve.protocol.registry import Load, Registration


def reg(i, role="decode", url=None):
    return Registration(instance_id=i, role=role, url=url or f"http://h:{len(i)}", model="m")


def test_register_heartbeat_expire():
    now = [0.0]
    r = Registry(heartbeat_timeout_s=6, clock=lambda: now[0])
    r.register(reg("a"))
    r.register(reg("bb", role="prefill"))
    rev = r.revision
    assert [i.instance_id for i in r.view().instances] == ["a", "bb"]
    assert [i.instance_id for i in r.view("prefill").instances] == ["bb"]
    now[0] = 5
    assert r.heartbeat("a", Load(running=3))
    r.register(reg("bb", role="prefill"))  # re-register, same place: no change
    assert r.revision == rev
    now[0] = 10
    assert r.expire() == []
    now[0] = 11.5
    assert sorted(r.expire()) == ["a", "bb"]
    assert r.view().instances == [] and r.revision > rev
    assert not r.heartbeat("a", Load())  # unknown -> the client registers again


def test_url_change_bumps_revision():
    r = Registry(6)
    r.register(reg("a"))
    rev = r.revision
    r.register(reg("a", url="http://other:1"))
    assert r.revision == rev + 1 and r.view().instances[0].url == "http://other:1"


def test_metaserver_registrar_beats_without_a_load():
    """A Heartbeat run with_load=False has no load in its body: the registrar's heartbeat then
    leaves it out (the metaserver's default) instead of failing on a missing key."""
    import http.server
    import json
    import threading

    import msgspec

    from ascendserve.discovery.heartbeat import MetaserverRegistrar
    from ascendserve.protocol.registry import Heartbeat

    posted: list[tuple[str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            posted.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registrar = MetaserverRegistrar(f"http://127.0.0.1:{server.server_address[1]}", "tok")
        body = {"instance_id": "m-1", "role": "metaserver", "url": "http://127.0.0.1:1", "model": ""}
        assert registrar.beat(body) is True  # registered
        assert registrar.beat(body) is False  # a heartbeat
        assert registrar.beat(dict(body, load={"running": 2, "waiting": 1})) is False
    finally:
        server.shutdown()
    assert [p for p, _ in posted] == ["/v1/registry/register", "/v1/registry/heartbeat", "/v1/registry/heartbeat"]
    beats = [msgspec.json.decode(raw, type=Heartbeat) for _, raw in posted[1:]]  # the wire contract
    assert beats[0].load.running == 0 and beats[1].load.running == 2
    assert "load" not in json.loads(posted[1][1])
