"""engine/patches/gloo_device.py: the gloo process groups of a process share one device.

Two real gloo ranks (loopback, forked from one child interpreter) make the
groups vLLM makes (a world plus 12 more, two of them single-rank), run
collectives on every one of them, and count their `gloo_tcp_loop` threads:
one per process with the fix, 12 without it (the same script, unpatched, is
the control). A process forked after its parent made a group makes its own
device (the parent's loop thread is not copied by fork). The name torch
constructs keeps torch's isinstance answers; apply() is idempotent and
refuses a torch without what it relies on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")

from ascendserve.engine.patches import gloo_device  # noqa: E402

RANKS = textwrap.dedent("""
    import json, os, sys, tempfile
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from ascendserve.engine.patches import gloo_device

    patched = sys.argv[1] == "patched"
    if patched:
        gloo_device.apply()

    def loops():
        return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop"
                   for t in os.listdir("/proc/self/task"))

    def rank_main(rank, store_path, out_path):
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
        groups = [dist.new_group([0, 1], backend="gloo") for _ in range(10)]
        mine = [dist.new_group([r], backend="gloo") for r in (0, 1)][rank]
        sums = []
        for g in [dist.group.WORLD, *groups]:
            t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t, group=g)
            sums.append(t.tolist())
        t = torch.full((2,), 5.0)
        dist.all_reduce(t, group=mine)
        obj = [{"from": 0}] if rank == 0 else [None]
        dist.broadcast_object_list(obj, src=0, group=groups[3])
        backend = groups[0]._get_backend(torch.device("cpu"))
        out = {"loops": loops(), "sums": sums, "single": t.tolist(), "object": obj[0],
               "isinstance": isinstance(backend, c10d.ProcessGroupGloo)}
        if rank == 0:  # a child forked after groups exist makes a device of its own
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                pg = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1)
                x = torch.ones(3)
                pg.allreduce([x]).wait()
                os.write(w, json.dumps({"loops": loops(), "sum": x.tolist()}).encode())
                os._exit(0)
            os.close(w)
            out["child"] = json.loads(os.read(r, 4096))
            os.waitpid(pid, 0)
        dist.barrier()
        dist.destroy_process_group()
        with open(out_path, "w") as f:
            json.dump(out, f)

    d = tempfile.mkdtemp()
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            try:
                rank_main(rank, os.path.join(d, "store"), os.path.join(d, f"{rank}.json"))
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    print(json.dumps([json.load(open(os.path.join(d, f"{r}.json"))) for r in (0, 1)]))
""")


def _ranks(mode: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", RANKS, mode], capture_output=True, text=True, timeout=180,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_ranks_share_one_device_per_process_and_their_collectives_agree():
    patched, plain = _ranks("patched"), _ranks("plain")
    for ranks in (patched, plain):
        for rank in ranks:
            assert rank["sums"] == [[3.0] * 4] * 11
            assert rank["single"] == [5.0, 5.0]
            assert rank["object"] == {"from": 0}
            assert rank["isinstance"] is True
    assert [r["loops"] for r in plain] == [12, 12]  # the control: a device (and loop) per group (12 here)
    assert [r["loops"] for r in patched] == [1, 1]
    assert patched[0]["child"] == {"loops": 1, "sum": [1.0, 1.0, 1.0]}


def test_the_installed_name_answers_isinstance_as_torch_does():
    from torch.distributed import distributed_c10d as c10d

    real = c10d.ProcessGroupGloo
    if getattr(real, gloo_device.PATCHED, False):  # apply_all ran in this process
        real = real.__mro__[1]
    fake = types.SimpleNamespace(ProcessGroupGloo=real)
    assert gloo_device.apply(fake) == ["torch.distributed ProcessGroupGloo: one gloo device per process"]
    installed = fake.ProcessGroupGloo
    assert installed is not real and installed.__name__ == "ProcessGroupGloo"
    assert issubclass(real, installed) and issubclass(installed, real)
    assert not isinstance(object(), installed) and not issubclass(int, installed)
    assert gloo_device.apply(fake) == []  # idempotent
    assert fake.ProcessGroupGloo is installed


def test_a_torch_without_what_it_relies_on_is_left_alone():
    class NoDevices:
        class _Options:
            pass

    for c10d in (types.SimpleNamespace(), types.SimpleNamespace(ProcessGroupGloo=NoDevices)):
        before = dict(vars(c10d))
        with pytest.raises(RuntimeError):
            gloo_device.apply(c10d)
        assert vars(c10d) == before
