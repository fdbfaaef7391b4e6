"""No product code deserializes with pickle or its relatives.

A port or file that unpickles runs whatever its sender wrote (DESIGN.md, wire
contracts). Every .py file under ascendserve/ and roles/ is parsed with `ast`
and refused for: importing a pickle-family module (plain, from-import, or by
name through __import__ / importlib.import_module), `torch.load` without
`weights_only=True`, and `numpy.load(..., allow_pickle=True)`. vLLM's own use
of pickle is vLLM's; only our code counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("ascendserve", "roles")
PICKLE_FAMILY = frozenset({"pickle", "cPickle", "_pickle", "pickletools", "copyreg", "dill", "cloudpickle",
                           "shelve", "marshal", "joblib", "jsonpickle"})


def _family(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PICKLE_FAMILY


def _kwarg(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def violations(source: str, filename: str = "<string>") -> list[str]:
    """Every pickle-family use in `source`, as 'file:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if _family(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if _family(node.module):
                found.append(f"{where}: from {node.module} import ...")
            found += [f"{where}: from {node.module} import {a.name}" for a in node.names if _family(a.name)]
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where}: from torch import load (call torch.load(..., weights_only=True))")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("__import__", "importlib.import_module", "import_module") and node.args \
                    and isinstance(node.args[0], ast.Constant) and _family(str(node.args[0].value)):
                found.append(f"{where}: {name}({node.args[0].value!r})")
            if name == "torch.load":
                if not _is_true(_kwarg(node, "weights_only")):
                    found.append(f"{where}: {name} without weights_only=True")
            if name in ("np.load", "numpy.load") and _is_true(_kwarg(node, "allow_pickle")):
                found.append(f"{where}: {name}(allow_pickle=True)")
    return found


def product_files() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (REPO / top).rglob("*.py"))


def test_product_code_never_unpickles():
    files = product_files()
    assert len(files) > 50, "the walk found too few files: wrong root?"
    found = [v for f in files for v in violations(f.read_text(encoding="utf-8"), str(f.relative_to(REPO)))]
    assert not found, "pickle-family use in product code:\n" + "\n".join(found)


def test_the_checker_catches_each_form():
    planted = {
        "import pickle": 1,
        "import cloudpickle as cp": 1,
        "from dill import loads": 1,
        "from multiprocessing import reduction\nimport marshal": 1,
        "from shelve import open as o": 1,
        "from joblib.numpy_pickle import load": 1,
        "from _pickle import loads": 1,
        "__import__('pickle')": 1,
        "import importlib\nimportlib.import_module('dill')": 1,
        "import torch\ntorch.load('x')": 1,
        "import torch\ntorch.load('x', weights_only=False)": 1,
        "from torch import load": 1,
        "import numpy as np\nnp.load('x', allow_pickle=True)": 1,
    }
    for source, n in planted.items():
        assert len(violations(source)) == n, source
    for clean in ("import json", "import torch\ntorch.load('x', weights_only=True)", "import msgspec",
                  "from safetensors.torch import load_file", "import numpy as np\nnp.load('x')",
                  "import picklist"):
        assert violations(clean) == [], clean
