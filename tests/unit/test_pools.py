from ascendserve.router.pools import ACTIVE, DRAINING, EJECTED, KV_WEIGHT, Pool, Pools


def active_pool(role, *urls):
    pool = Pool(role)
    for url in urls:
        pool.set_state(pool.add(url), ACTIVE)
    return pool


def test_selects_least_loaded_and_follows_counter_changes():
    pool = active_pool("decode", "a", "b", "c")
    la = pool.lease(pool.instances["a"], 100)
    lb = pool.lease(pool.instances["b"], 50)
    assert pool.select().url == "c"
    lc = pool.lease(pool.instances["c"], 75)
    assert pool.select().url == "b"
    la.release()
    assert pool.select().url == "a"
    lb.release(), lc.release()
    assert all(i.active_tokens == 0 and i.active_requests == 0 for i in pool.instances.values())


def test_prefill_priority_counts_kv_held_for_decode():
    pool = active_pool("prefill", "p1", "p2")
    pool.lease(pool.instances["p1"], 0, kv=100)   # 0.3 * 100 = 30
    pool.lease(pool.instances["p2"], 40)          # 40
    assert pool.instances["p1"].priority == KV_WEIGHT * 100
    assert pool.select().url == "p1"


def test_release_is_idempotent():
    pool = active_pool("decode", "a")
    lease = pool.lease(pool.instances["a"], 10)
    lease.release()
    lease.release(ok=False)
    inst = pool.instances["a"]
    assert (inst.active_requests, inst.active_tokens, inst.served) == (0, 0, 1)


def test_exclude_skips_without_losing_entries():
    pool = active_pool("decode", "a", "b")
    pool.lease(pool.instances["b"], 10)
    assert pool.select(frozenset({"a"})).url == "b"
    assert pool.select().url == "a"
    assert pool.select(frozenset({"a", "b"})) is None


def test_ejected_and_probing_not_selected():
    pool = active_pool("decode", "a", "b")
    pool.set_state(pool.instances["a"], EJECTED)
    pool.add("c")  # probing
    assert {pool.select().url} == {"b"}
    pool.set_state(pool.instances["a"], ACTIVE)
    pool.lease(pool.instances["b"], 5)
    assert pool.select().url == "a"


def test_drain_waits_for_own_requests_then_forgets():
    pool = active_pool("decode", "a", "b")
    lease = pool.lease(pool.instances["a"], 10)
    pool.drain("a")
    assert pool.instances["a"].state == DRAINING
    assert pool.select().url == "b"
    pool.set_state(pool.instances["a"], ACTIVE)  # health cannot undo a removal
    assert pool.instances["a"].state == DRAINING
    lease.release()
    assert "a" not in pool.instances
    pool.drain("b")
    assert "b" not in pool.instances and pool.select() is None


def test_heap_stays_bounded_under_churn():
    pool = active_pool("decode", "a", "b")
    for _ in range(10_000):
        pool.lease(pool.instances["a"], 1).release()
    assert len(pool._heap) <= 64 + 8 * len(pool.instances) + 1


def test_pools_models_and_in_flight():
    pools = Pools()
    inst = pools["pd"].add("x")
    inst.models = ("m1",)
    assert pools.models() == []  # probing instances advertise nothing
    pools["pd"].set_state(inst, ACTIVE)
    pools["pd"].lease(inst, 3)
    assert pools.models() == ["m1"] and pools.in_flight() == 1
