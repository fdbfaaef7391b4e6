"""Live engine instances, each on a heartbeat deadline.

`on_change(kind, registration)` hears every change of the set (the dashboard's event feed):
joined, restarted (registered again while still registered: a new process at the same id),
left (deregistered), expired (missed its heartbeat deadline)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ascendserve.protocol.registry import InstanceView, Load, Registration, RegistryView


@dataclass
class _Entry:
    reg: Registration
    registered_at: float
    deadline: float


class Registry:
    def __init__(self, heartbeat_timeout_s: float, clock=time.monotonic):
        self.timeout = heartbeat_timeout_s
        self.clock = clock
        self.revision = 0
        self._entries: dict[str, _Entry] = {}
        self.on_change: Callable[[str, Registration], None] = lambda kind, reg: None

    def register(self, reg: Registration) -> None:
        now = self.clock()
        old = self._entries.get(reg.instance_id)
        self._entries[reg.instance_id] = _Entry(reg, old.registered_at if old else now, now + self.timeout)
        if old is None or old.reg.url != reg.url or old.reg.role != reg.role or old.reg.model != reg.model:
            self.revision += 1
        self.on_change("joined" if old is None else "restarted", reg)

    def heartbeat(self, instance_id: str, load: Load) -> bool:
        entry = self._entries.get(instance_id)
        if entry is None:
            return False
        entry.reg.load = load
        entry.deadline = self.clock() + self.timeout
        return True

    def remove(self, instance_id: str, why: str = "left") -> bool:
        entry = self._entries.pop(instance_id, None)
        if entry is None:
            return False
        self.revision += 1
        self.on_change(why, entry.reg)
        return True

    def expire(self) -> list[str]:
        """Drop every instance whose heartbeat deadline passed; return their ids."""
        now = self.clock()
        gone = [i for i, e in self._entries.items() if e.deadline < now]
        for instance_id in gone:
            self.remove(instance_id, "expired")
        return gone

    def silent_s(self) -> dict[str, float]:
        """Seconds since each instance's last registration or heartbeat."""
        now = self.clock()
        return {i: max(0.0, now - (e.deadline - self.timeout)) for i, e in self._entries.items()}

    def view(self, role: str | None = None) -> RegistryView:
        now = self.clock()
        return RegistryView(
            revision=self.revision, heartbeat_timeout_s=self.timeout,
            instances=[InstanceView(instance_id=i, role=e.reg.role, url=e.reg.url, model=e.reg.model,
                                    version=e.reg.version, load=e.reg.load, age_s=round(now - e.registered_at, 3),
                                    seed=e.reg.seed, seed_model=e.reg.seed_model, kv=e.reg.kv,
                                    cache=e.reg.cache)
                       for i, e in sorted(self._entries.items()) if role is None or e.reg.role == role])
