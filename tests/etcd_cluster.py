"""A real etcd cluster on 127.0.0.1 for the registry tests (Debian's etcd-server; scripts/install.sh
installs it). Each member is a tests.procs.Proc, so a test SIGKILLs or restarts one like any role."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.procs import Proc

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def need_etcd() -> None:
    if not Path(ETCD).exists():
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server; scripts/install.sh does)")


class EtcdCluster:
    def __init__(self, root: Path, members: int = 3, name: str = "etcd"):
        need_etcd()
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ports = [(free_port(), free_port()) for _ in range(members)]  # (client, peer)
        names = [f"{name}{i}" for i in range(members)]
        initial = ",".join(f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, self.ports))
        self.members: list[Proc] = []
        for n, (client, peer) in zip(names, self.ports):
            argv = [ETCD, "--name", n, "--data-dir", str(root / n),
                    "--listen-client-urls", f"http://127.0.0.1:{client}",
                    "--advertise-client-urls", f"http://127.0.0.1:{client}",
                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", initial, "--initial-cluster-state", "new",
                    "--initial-cluster-token", f"{name}-{self.ports[0][0]}",
                    # small: a test's etcd holds a few keys (the default 2 GiB quota is only an mmap)
                    "--quota-backend-bytes", str(64 << 20), "--log-level", "warn"]
            self.members.append(Proc(n, argv, client, root / f"{n}.log", {}, "/health", memory_gib=0.0))

    @property
    def endpoints(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self) -> "EtcdCluster":
        for m in self.members:
            m.start()
        for m in self.members:
            m.wait_ready(60)
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop(timeout=5)


def registry_flags(cluster: EtcdCluster, ttl_s: int = 3, name: str = "default") -> list[str]:
    """An ascendserve role's flags for this etcd."""
    return ["--registry-backend", "etcd", "--registry-endpoints", *cluster.endpoints,
            "--registry-lease-ttl", str(ttl_s), "--registry-cluster", name]


def stub_flags(cluster: EtcdCluster, ttl_s: int = 3, name: str = "default") -> list[str]:
    """A stub engine's flags (tests/stub_backend.py) for this etcd."""
    return ["--registry-endpoints", ",".join(cluster.endpoints), "--lease-ttl", str(ttl_s),
            "--registry-cluster", name]
