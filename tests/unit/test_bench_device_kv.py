"""bench/device_kv.py, the script a GPU host runs once, runs here on CPU tensors through the
same staging code (small request), so it cannot rot between GPU loans."""

from __future__ import annotations

from bench.device_kv import LAYOUTS, run


def test_device_kv_bench_moves_every_layout_bit_exact_on_cpu():
    rows, raw = run("cpu", mib=4, repeat=1)
    assert [r[0] for r in rows] == list(LAYOUTS)
    assert all(r[-1] == "yes" for r in rows), rows
    assert all(raw[layout]["exact"] and raw[layout]["exact_heads"] for layout in LAYOUTS)
