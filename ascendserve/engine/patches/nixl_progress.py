"""NIXL's UCX progress thread waits for UCX events instead of spinning, when asked for.

nixl 1.5.1's Python agent hard-codes its progress thread's delay to 0
(`nixl_agent.__init__`: `agent_config.pthrDelay = 0`), and the UCX backend's
thread then loops on `ucp_worker_arm` and `poll(..., 0)`: a whole core per
engine that runs vLLM's NixlConnector, busy or idle. vLLM builds the agent
itself and passes no such setting. Measured on a 2-core CPU host (1P1D over
UCX tcp, tiny model): the idle P and D used 2 cores between them; 16 requests
at once took 1.0-1.5 s, one after another 0.2 s each, and in the test suite,
beside other engines, single reads stalled 5-24 s and a decode missed its
health checks. With a delay the thread arms UCX's event descriptors and
sleeps in poll() until an event or the delay: idle CPU 2 %, 16 at once
0.4-0.6 s, one after another 0.07 s.

ASCENDSERVE_NIXL_PROGRESS_DELAY_US (microseconds; engine/kv_args.py sets 1000
on CPU hosts for `--kv-connector nixl`, unset elsewhere: accelerator hosts
keep NIXL's spin, which RDMA latency may want). Installed by wrapping the
binding's `nixlAgent` constructor that `nixl._api` calls, so every agent made
in the process gets the delay where NIXL left it at 0; feature-tested: the
binding's agent config must have `pthrDelay`, else apply() raises and nothing
is changed.
"""

from __future__ import annotations

import os
import types

ENV = "ASCENDSERVE_NIXL_PROGRESS_DELAY_US"
PATCHED = "_ascendserve_nixl_progress"


def delay_us(environ=os.environ) -> int | None:
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV}={raw!r}: expected microseconds, an integer >= 0")
    return value or None


class _Binding(types.ModuleType):
    """NIXL's binding module with `nixlAgent` replaced; everything else is the binding's."""

    def __init__(self, binding, agent):
        super().__init__(binding.__name__)
        self._binding, self.nixlAgent = binding, agent
        setattr(self, PATCHED, True)

    def __getattr__(self, name):
        return getattr(self._binding, name)


def apply(api=None, environ=os.environ) -> list[str]:
    delay = delay_us(environ)
    if delay is None:
        return []
    if api is None:
        import nixl._api as api  # nixl's package puts the build's real module here
    binding = api.nixlBind
    if getattr(binding, PATCHED, False):
        return []
    binding.nixlAgentConfig().pthrDelay  # noqa: B018 (AttributeError: a NIXL without the setting)
    real = binding.nixlAgent

    def nixlAgent(name, config, *args, **kwargs):
        if getattr(config, "useProgThread", False) and config.pthrDelay == 0:
            config.pthrDelay = delay
        return real(name, config, *args, **kwargs)

    api.nixlBind = _Binding(binding, nixlAgent)
    return ["nixl_progress"]
