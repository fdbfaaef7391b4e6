"""Make torchvision's Python transforms importable beside a CPU-only torch.

PyPI's x86_64 torchvision wheel is a CUDA build. Beside torch's CPU wheel its
C++ extension fails to load, and ``import torchvision`` then dies while
registering fake kernels for ``torchvision::nms`` / ``torchvision::qnms``
because those schemas were never defined. vLLM's Qwen2-VL family only uses the
Python transforms, so defining the two schemas (no kernels) is enough.

Called from the vLLM plugin hook (every vLLM process) and from the engine
roles before vLLM is imported. A no-op when torchvision is absent or its native ops load. Safe to call
while torchvision itself is being imported (it imports torch first).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
# The Library object owns the definitions; it must outlive this call.
_library = None


def _has_nms_schema(torch) -> bool:
    try:
        torch.ops.torchvision.nms.default
        return True
    except (AttributeError, RuntimeError):
        return False


def ensure_torchvision_importable() -> bool:
    """Return True when the schemas had to be defined here."""
    global _library
    if _library is not None:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    if _has_nms_schema(torch):
        return False
    pkg_dir = list(spec.submodule_search_locations)[0]
    for lib_path in glob.glob(os.path.join(pkg_dir, "_C*.so")):
        try:
            torch.ops.load_library(lib_path)
            return False  # a torchvision build that matches this torch
        except (OSError, RuntimeError):
            break
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        library.define(schema)
    _library = library
    return True


def autoload() -> None:
    """``torch.backends`` entry point: runs at the end of every ``import torch``.

    That is the one hook that precedes transformers' unconditional
    ``import torchvision`` in every process (vLLM's API server, its spawned
    engine cores and workers, plain ``transformers`` users). It must never
    raise: an exception here would break ``import torch`` itself.
    """
    try:
        ensure_torchvision_importable()
    except Exception as exc:  # pragma: no cover - defensive
        print(f"ascendserve: torchvision compat skipped: {exc!r}", file=sys.stderr)
