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
