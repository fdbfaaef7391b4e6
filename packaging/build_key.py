"""The cache key of the release's PyInstaller stage (run by ../build.sh with the venv's Python).

    python packaging/build_key.py REPO FORMAT VERSION DEVICE --inputs   prints what the key hashes
    python packaging/build_key.py REPO FORMAT VERSION DEVICE            prints the key (24 hex digits)

The bundle depends on what PyInstaller analyses: the Python and PyInstaller that
freeze it, every installed distribution (name, version, how it was installed),
the spec and the entry script, pyproject.toml (our dist-info's entry points)
and the release name (version, device). Our own sources (ascendserve/,
roles/, the native library) are copied into every build afresh, so their text
is not in the key, only what they import from outside: a module of ours that
starts importing something new (`import foo`, `from foo import bar` where
foo/bar is a submodule) changes the key, so the analysis sees it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

OURS = ("ascendserve", "roles")
FILES = ("packaging/ascendserve.spec", "packaging/entry.py", "pyproject.toml")


def distributions() -> list[str]:
    """name==version (+ how: direct_url.json) of everything installed but ascendserve itself."""
    out = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if not name or name == "ascendserve":
            continue
        how = (dist.read_text("direct_url.json") or "").strip()
        out.add(f"{name}=={dist.version} {how}".strip())
    return sorted(out)


def _is_submodule(module: str, name: str) -> bool:
    """Whether module.name is a module, found on disk: importing packages (vllm, torch) to ask would take seconds."""
    try:
        spec = importlib.util.find_spec(module.split(".")[0])  # a top-level spec imports nothing
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    rel = Path(*module.split(".")[1:], name)
    for base in spec.submodule_search_locations:
        where = Path(base) / rel
        if where.is_dir() or where.with_suffix(".py").is_file() or any(where.parent.glob(f"{name}.*.so")):
            return True
    return False


def external_imports(repo: Path) -> list[str]:
    """Absolute imports in our packages of modules that are not ours."""
    found: set[str] = set()
    for pkg in OURS:
        for path in sorted((repo / pkg).rglob("*.py")):
            try:
                tree = ast.parse(path.read_bytes(), str(path))
            except SyntaxError:
                found.add(f"<unparsable {path.relative_to(repo)}>")  # PyInstaller would choke as well
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names
                                 if a.name != "*" and _is_submodule(node.module, a.name))
    return sorted(m for m in found if m.split(".")[0] not in OURS)


def inputs(repo: Path, fmt: str, version: str, device: str) -> list[str]:
    import PyInstaller

    lines = [f"format {fmt}", f"release {version} {device} {platform.machine()}",
             f"python {sys.version.split()[0]} {sys.implementation.cache_tag}",
             f"pyinstaller {PyInstaller.__version__}"]
    for rel in FILES:
        data = (repo / rel).read_bytes() if (repo / rel).is_file() else b""
        lines.append(f"file {rel} {hashlib.sha256(data).hexdigest()}")
    lines += [f"dist {d}" for d in distributions()]
    lines += [f"import {m}" for m in external_imports(repo)]
    return lines


def main(argv: list[str]) -> None:
    show = "--inputs" in argv
    repo, fmt, version, device = [a for a in argv if a != "--inputs"]
    text = "".join(line + "\n" for line in inputs(Path(repo).resolve(), fmt, version, device))
    # the key is what build.sh makes of the --inputs text: `sha256sum | cut -c1-24`
    print(text, end="") if show else print(hashlib.sha256(text.encode()).hexdigest()[:24])


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    main(sys.argv[1:])
