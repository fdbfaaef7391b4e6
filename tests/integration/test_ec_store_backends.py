"""The EC store backends against their real servers on 127.0.0.1: memcached (chunked) and Mooncake Store."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ascendserve.connectors.ec import memcached
from ascendserve.connectors.ec.backends import MemcachedStore, MooncakeStore
from tests.procs import free_port, wait_for

pytestmark = pytest.mark.integration


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def memcached_url():
    port = free_port()
    user = ["-u", "root"] if os.getuid() == 0 else []
    p = subprocess.Popen(["memcached", *user, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-m", "64", "-I", "1m"])
    url = f"127.0.0.1:{port}"
    c = memcached.Client(url)

    def up():
        try:
            return c.stats() is not None
        except memcached.StoreError:
            return False
    wait_for(up, 10, "memcached did not start")
    c.close()
    yield url
    p.terminate()
    p.wait(10)


def test_memcached_items_over_the_item_limit_are_chunked(memcached_url):
    store = MemcachedStore(memcached_url, chunk_bytes=512 << 10, ttl_s=60)
    data = payload(3 << 20 | 123, 1)  # 3 MiB + 123 B: 7 chunks of at most 512 KiB, server limit 1 MiB
    assert store.put("h1", data, "uint8", (data.size,))
    info = store.info("h1")
    assert info is not None and info.nbytes == data.size and info.shape == (data.size,)
    out = np.empty(data.size, np.uint8)
    assert store.read_into("h1", info, out) and np.array_equal(out, data)
    keys = memcached.Client(memcached_url).keys()
    assert len([k for k in keys if k.startswith("asf-ec:h1")]) == 1 + 7
    store.delete("h1")
    assert store.info("h1") is None
    assert not [k for k in memcached.Client(memcached_url).keys() if k.startswith("asf-ec:")]


def test_memcached_refused_chunks_leave_nothing(memcached_url):
    store = MemcachedStore(memcached_url, chunk_bytes=2 << 20, ttl_s=60)  # above the 1 MiB item limit
    data = payload(3 << 20, 2)
    assert not store.put("h2", data, "uint8", (data.size,))
    assert store.info("h2") is None
    assert not [k for k in memcached.Client(memcached_url).keys() if k.startswith("asf-ec:")]


def test_memcached_unreachable_is_a_store_error():
    store = MemcachedStore(f"127.0.0.1:{free_port()}", chunk_bytes=1 << 16, ttl_s=60, timeout_s=0.5)
    with pytest.raises(memcached.StoreError, match="unreachable"):
        store.info("h3")


# ---- Mooncake Store --------------------------------------------------------------------
MASTER = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")


def _producer(master: str, q, done) -> None:
    store = MooncakeStore(master, "127.0.0.1", 64 << 20, 16 << 20, "P2PHANDSHAKE")
    data = payload(3 << 20, 4)
    q.put(store.put("m1", data, "float32", (3 << 18,)))
    done.wait(120)
    store.close()


@pytest.mark.skipif(not os.path.exists(MASTER), reason="mooncake_master is not installed (pip install ascendserve[mooncake])")
def test_mooncake_store_between_processes():
    port = free_port()
    master = subprocess.Popen([MASTER, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_host=127.0.0.1",
                               f"--metrics_port={free_port()}", "--rpc_thread_num=4"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "MC_LOG_LEVEL": "WARNING"})
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    producer = None
    try:
        time.sleep(1.5)
        addr = f"127.0.0.1:{port}"
        producer = ctx.Process(target=_producer, args=(addr, q, done))
        producer.start()
        assert q.get(timeout=120) is True
        consumer = MooncakeStore(addr, "127.0.0.1", 0, 16 << 20, "P2PHANDSHAKE")  # contributes no memory
        info = consumer.info("m1")
        assert info is not None and info.dtype == "float32" and info.shape == (3 << 18,)
        out = np.empty(info.nbytes, np.uint8)
        assert consumer.read_into("m1", info, out) and np.array_equal(out, payload(3 << 20, 4))
        assert consumer.info("absent") is None
        consumer.delete("m1")
        assert consumer.info("m1") is None
        consumer.close()
    finally:
        done.set()
        if producer is not None:
            producer.join(30)
        master.terminate()
        master.wait(20)
