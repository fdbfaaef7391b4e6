"""Proxy workers (router/workers.py): the shared table and counters, the leader's table mirrored
by a follower, notes from a follower to the leader, and the supervisor. Forked processes where the
sharing crosses processes; no network."""

import asyncio
import os
import signal
import time

import msgspec
import pytest

from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.router import workers
from ascendserve.router.pools import ACTIVE, DRAINING, EJECTED, PROBING, SUSPECT, Pools
from ascendserve.router.workers import Counters, Leader, Mirror, Relay, Shared, Table, Worker


def worker(shared, index, address="\0unused"):
    return Worker(index, shared.workers, shared, address, "")


class FakeHealth:
    def __init__(self):
        self.calls = []

    def wake(self):
        self.calls.append(("wake", None))

    def report_failure(self, inst):
        self.calls.append(("failure", inst.url))

    def suspect(self, inst):
        self.calls.append(("suspect", inst.url))


def two_workers(*decode_urls):
    shared = Shared(2)
    lead, follow = Pools(), Pools()
    lead.share(Counters(shared, 0))
    follow.share(Counters(shared, 1))
    for url in decode_urls:
        lead["decode"].set_state(lead["decode"].add(url), ACTIVE)
    leader = Leader(worker(shared, 0), lead, FakeHealth(), lambda: ["http://ms:1"])
    changes = []
    mirror = Mirror(worker(shared, 1), follow, on_state=lambda i, s, b: changes.append((i.url, b, s)))
    return shared, lead, follow, leader, mirror, changes


def test_worker_count_defaults_to_the_cores_given_at_most_eight(monkeypatch, tmp_path):
    assert workers.worker_count(3) == 3
    none = str(tmp_path / "absent")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(2)))
    assert workers.worker_count(0, none) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(32)))
    assert workers.worker_count(0, none) == workers.AUTO_MAX
    quota = tmp_path / "cpu.max"
    quota.write_text("250000 100000\n")  # --cpus 2.5: 3 workers
    assert workers.worker_count(0, str(quota)) == 3
    quota.write_text("max 100000\n")
    assert workers.worker_count(0, str(quota)) == workers.AUTO_MAX


def test_table_round_trips_and_a_torn_read_is_retried():
    shared = Shared(2)
    assert shared.read() == (0, b"")
    for n in range(5):
        assert shared.publish(b"x" * n + b"!")
        assert shared.read() == (n + 1, b"x" * n + b"!")
    assert not shared.publish(b"y" * (workers.SNAP_MAX + 1))
    assert shared.read()[1] == b"xxxx!"  # a refused table leaves the last one


def test_the_follower_mirrors_states_and_fields_and_forgets_what_the_leader_dropped():
    shared, lead, follow, leader, mirror, changes = two_workers("http://d1", "http://d2")
    lead["decode"].instances["http://d1"].kv = KVInfo(connector="ascendserve", host="h", port=7)
    lead["decode"].instances["http://d2"].models = ("m",)
    lead["decode"].instances["http://d2"].remember_fingerprint("fp-2")
    leader.publish()
    mirror.poll()
    assert follow["decode"].instances["http://d2"].fingerprint == "fp-2"
    d1, d2 = follow["decode"].instances["http://d1"], follow["decode"].instances["http://d2"]
    assert (d1.state, d2.state, d1.kv.port, d2.models) == (ACTIVE, ACTIVE, 7, ("m",))
    assert sorted(changes) == [("http://d1", PROBING, ACTIVE), ("http://d2", PROBING, ACTIVE)]
    assert mirror.metaservers == ["http://ms:1"]
    assert d1.slot >= 0 and d2.slot >= 0 and d1.slot != d2.slot

    changes.clear()
    lead["decode"].set_state(lead["decode"].instances["http://d1"], EJECTED)
    lease = follow["decode"].lease(d2, 10)  # the follower's own request on d2
    lead["decode"].forget("http://d2")
    leader.publish()
    mirror.poll()
    assert changes == [("http://d1", ACTIVE, EJECTED)]
    assert d2.state == DRAINING and "http://d2" in follow["decode"].instances  # its request finishes
    lease.release()
    assert "http://d2" not in follow["decode"].instances
    gen = mirror.generation
    leader.publish()  # nothing changed: nothing published
    assert shared.generation() == gen


def test_each_worker_counts_the_others_load_and_choice_follows_it():
    shared, lead, follow, leader, mirror, _ = two_workers("http://d1", "http://d2")
    leader.publish()
    mirror.poll()
    ld1 = lead["decode"].instances["http://d1"]
    fd1, fd2 = follow["decode"].instances["http://d1"], follow["decode"].instances["http://d2"]
    leases = [lead["decode"].lease(ld1, 100) for _ in range(3)]  # worker 0's load on d1
    assert fd1.peer_load() == (3, 300, 0) and fd1.total_requests == 3
    assert follow["decode"].select() is fd2  # the follower sees it and picks d2
    mine = follow["decode"].lease(fd2, 500)
    assert follow["decode"].select() is fd1 and lead["decode"].select() is ld1  # 300 < 500 both ways
    assert ld1.summary()["active_requests"] == 3 and lead["decode"].instances["http://d2"].total_requests == 1
    for lease in leases:
        lease.release()
        lease.release()  # once only
    mine.release()
    assert [i.total_requests for i in lead.all_instances() + follow.all_instances()] == [0, 0, 0, 0]
    shared.clear_row(0)
    assert fd1.peer_load() == (0, 0, 0)


def test_a_suspect_is_chosen_only_while_no_instance_is_active():
    shared, lead, follow, leader, mirror, _ = two_workers("http://d1", "http://d2")
    lead["decode"].set_state(lead["decode"].instances["http://d1"], SUSPECT)
    leader.publish()
    mirror.poll()
    assert follow["decode"].select().url == "http://d2"
    assert follow["decode"].select(frozenset({"http://d2"})) is None  # an active one exists, excluded
    lead["decode"].set_state(lead["decode"].instances["http://d2"], EJECTED)
    leader.publish()
    mirror.poll()
    assert follow["decode"].select().url == "http://d1"


def test_notes_from_a_follower_reach_the_leader_over_the_datagram_socket():
    shared = Shared(2)
    address = f"\0ascendserve-test-{os.getpid()}-{time.monotonic_ns()}"
    lead = Pools()
    lead.share(Counters(shared, 0))
    d1 = lead["decode"].add("http://d1")
    health = FakeHealth()
    leader = Leader(Worker(0, 2, shared, address, ""), lead, health, None)
    added = []
    leader.on_add = lambda role, url: added.append((role, url))
    relay = Relay(Worker(1, 2, shared, address, ""))

    async def main():
        task = asyncio.ensure_future(leader.run())
        await asyncio.sleep(0.05)
        relay.report_failure(d1)
        relay.suspect(d1)
        relay.tell("add", "prefill", "http://p9")
        relay.tell("add", "nonsense", "http://x")  # unknown role: ignored
        leader.note(b"not json")  # ignored, logged
        relay.wake()
        relay.tell("fingerprint", "decode", "http://d1", "vllm-fp-1")  # learned by a follower
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert health.calls == [("failure", "http://d1"), ("suspect", "http://d1"), ("wake", None)]
    assert added == [("prefill", "http://p9")]
    assert d1.fingerprint == "vllm-fp-1"
    leader.publish()
    entry = msgspec.json.decode(leader._last, type=Table).instances[0]
    assert (entry.url, entry.fingerprint) == ("http://d1", "vllm-fp-1")  # every follower learns it


def test_counters_cross_processes():
    shared = Shared(2)
    pools = Pools()
    pools.share(Counters(shared, 0))
    inst = pools["decode"].add("http://d1")
    inst.slot = 5
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # worker 1: three requests of 7 tokens on slot 5
        child = Pools()
        child.share(Counters(shared, 1))
        other = child["decode"].add("http://d1")
        other.slot = 5
        leases = [child["decode"].lease(other, 7) for _ in range(4)]
        leases.pop().release(ok=True)  # one answered: served by worker 1
        os.write(write, b"x")
        time.sleep(5)
        os._exit(len(leases))
    os.read(read, 1)
    assert inst.peer_load() == (3, 21, 0)
    pools["decode"].lease(inst, 2).release(ok=True)
    assert (inst.served, inst.total_served) == (1, 2)
    assert inst.summary()["served"] == 2, "/instances counts every worker's answers"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    shared.clear_row(1)  # what the supervisor does before it restarts a worker
    assert inst.peer_load() == (0, 0, 0) and inst.total_served == 1


def _supervising(count: int, serve, started) -> int:
    """supervise(count, serve) in a forked child of the test; its pid once `started()` (10 s at most)."""
    pid = os.fork()
    if pid == 0:
        os._exit(workers.supervise(count, serve))
    deadline = time.monotonic() + 10
    while not started() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def test_supervisor_restarts_a_dead_worker_and_stops_on_sigterm(tmp_path):
    """supervise() in a child of the test: worker 1 dies once and is restarted; SIGTERM ends all."""
    marks = tmp_path / "marks"
    marks.mkdir()

    def serve(w):
        (marks / f"{w.index}-{os.getpid()}").touch()
        if w.index == 1 and len(list(marks.glob("1-*"))) == 1:
            return 3  # the first worker 1 dies
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        time.sleep(60)
        return 0

    pid = _supervising(2, serve, lambda: len(list(marks.iterdir())) >= 3)
    assert sorted(p.name.split("-")[0] for p in marks.iterdir()) == ["0", "1", "1"]
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for mark in marks.iterdir():  # every worker is gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(mark.name.split("-")[1]), 0)


def test_supervisor_gives_up_on_workers_that_keep_dying(monkeypatch):
    monkeypatch.setattr(workers, "RESTARTS", 2)
    pid = os.fork()
    if pid == 0:
        os._exit(workers.supervise(2, lambda w: 1))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1


def test_a_dashboard_login_through_one_worker_holds_in_the_others():
    from ascendserve.dashboard.access import Access

    shared = Shared(2)
    now = [100.0]
    one, two = (Access("tok", False, 8000, clock=lambda: now[0], max_sessions=3,
                       sessions=workers.SharedSessions(shared)) for _ in range(2))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # worker 1 logs in
        os.write(write, (one.login("tok") or "").encode())
        os._exit(0)
    session = os.read(read, 200).decode()
    os.waitpid(pid, 0)
    assert session and two.valid(session) and not two.valid(session + "x")
    assert two.login("wrong") is None
    others = [two.login("tok") for _ in range(3)]  # at most 3: the oldest (the first) goes
    assert not two.valid(session) and all(two.valid(s) for s in others)
    two.logout(others[0])
    assert not one.valid(others[0]) and one.valid(others[1])
    now[0] += 13 * 3600  # past the TTL
    assert not one.valid(others[1])
    assert len(workers.SharedSessions(shared)) == 1  # expired ones go at the next login or look-up


def test_requests_one_after_another_take_turns_as_with_one_worker():
    """Equal load: the least recently used instance, like the single process's heap order."""
    shared, lead, follow, leader, mirror, _ = two_workers("http://d1", "http://d2", "http://d3")
    leader.publish()
    mirror.poll()
    for pools in (lead, follow):
        chosen = []
        for _ in range(6):
            inst = pools["decode"].select()
            pools["decode"].lease(inst, 10).release()
            chosen.append(inst.url)
        assert sorted(chosen[:3]) == ["http://d1", "http://d2", "http://d3"] and chosen[3:] == chosen[:3]


def test_a_restarted_leader_numbering_slots_anew_leaves_no_stale_load():
    shared, lead, follow, leader, mirror, _ = two_workers("http://d1", "http://d2")
    leader.publish()
    mirror.poll()
    fd1 = follow["decode"].instances["http://d1"]
    lease = follow["decode"].lease(fd1, 40)
    old = fd1.slot
    # worker 0 restarts: fresh pools, slots from the start again, d2 first this time
    shared.clear_row(0)
    lead2 = Pools()
    lead2.share(Counters(shared, 0))
    for url in ("http://d2", "http://d1"):
        lead2["decode"].set_state(lead2["decode"].add(url), ACTIVE)
    leader2 = Leader(worker(shared, 0), lead2, FakeHealth(), None)
    leader2.publish()
    mirror.poll()
    assert fd1.slot != old
    assert lead2["decode"].instances["http://d1"].peer_load() == (1, 40, 0)  # the follower's stream, moved
    assert lead2["decode"].instances["http://d2"].peer_load() == (0, 0, 0)  # not left in d1's old slot
    lease.release()
    assert lead2["decode"].instances["http://d1"].peer_load() == (0, 0, 0)


def test_the_metrics_directory_of_a_killed_supervisor_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """A SIGKILLed supervisor never runs its cleanup: its workers' metrics files stay. The next
    supervisor on the host removes every such directory whose supervisor is gone, never a live one's."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started = tmp_path / "started"

    def serve(w):
        started.touch()
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the supervisor's death signal
        time.sleep(60)
        return 0

    pid = _supervising(1, serve, started.exists)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(workers.METRICS_PREFIX)]
    assert left.name.startswith(f"{workers.METRICS_PREFIX}{pid}-")
    live = tmp_path / f"{workers.METRICS_PREFIX}{os.getpid()}-abc"  # this process: alive
    live.mkdir()
    other = tmp_path / f"{workers.METRICS_PREFIX}notapid"
    other.mkdir()
    assert workers.sweep_metrics_dirs() == [str(left)]
    assert not left.exists() and live.exists() and other.exists()
