"""bench/device_kv.py, the script a GPU host runs once, runs here on CPU tensors through the
same staging code (small request), so it cannot rot between GPU loans."""

from __future__ import annotations

from bench.device_kv import LAYOUTS, run, transfer


def test_device_kv_bench_moves_every_layout_bit_exact_on_cpu():
    rows, raw = run("cpu", mib=4, repeat=1)
    assert [r[0] for r in rows] == list(LAYOUTS)
    assert all(r[-1] == "yes" for r in rows), rows
    assert all(raw[layout]["exact"] and raw[layout]["exact_heads"] for layout in LAYOUTS)
    assert raw["cuda_kernels"] == "not a CUDA device"
    for layout in LAYOUTS:  # every staging buffer came back, and was reused across the repeats
        for side in raw[layout]["staging"].values():  # (two for the pipeline, one for a head range)
            assert side["in_use"] == 0 and side["allocated"] <= 3, side


def test_device_kv_bench_moves_a_request_between_two_processes_on_cpu():
    rows, raw = transfer("cpu", mib=4, repeat=1)
    assert [r[0] for r in rows] == ["LBHNC", "BLHNC"] and all(r[-1] == "yes" for r in rows), rows
