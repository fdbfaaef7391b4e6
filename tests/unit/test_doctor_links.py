"""doctor's multi-node link checks (ascendserve/doctor/npu_links.py, cuda_links.py) on canned
hccn_tool / npu-smi / nvidia-smi outputs, good and bad, through an injected command runner."""

from __future__ import annotations

import time

import pytest

from ascendserve.doctor import npu_links
from ascendserve.doctor.base import FAIL, NOT_FOUND, OK, SKIP, TIMED_OUT, WARN, Output, run_tool
from ascendserve.doctor.cuda_links import cuda_link_checks, parse_topo
from ascendserve.doctor.npu_links import npu_link_checks, parse_ping

NPU_SMI_A2 = """+------------------------------------------------------------------------------------------------+
| npu-smi 25.2.0                   Version: 25.2.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| 0     910B3               | OK            | 93.2        36                0    / 0             |
"""
NPU_SMI_A3 = NPU_SMI_A2.replace("910B3              ", "Ascend910          ") + \
    "| 0     0                   | 0000:9D:00.0  | 0           0    / 0          3390 / 65536 |\n" \
    "| Chip Name: 910_9392                                                                    |\n"
LLDP = "Chassis ID TLV\n\tMAC: 80:b5:75:1b:6a:00\nPort ID TLV\n\tIfname: 400GE1/0/{n}\nSystem Name TLV\n\tSW-1\n"
PING_OK = ("device {n} PING {ip}\nrecv seq=0,time=0.080000ms\nrecv seq=1,time=0.045000ms\n"
           "3 packets transmitted, 3 received, 0.00% packet loss\n")
PING_LOST = ("device {n} PING {ip}\nrecv time out seq=0\nrecv time out seq=1\nrecv time out seq=2\n"
             "3 packets transmitted, 0 received, 100.00% packet loss\n")


def a2_answers(n: int) -> dict[str, str]:
    return {"-lldp": LLDP.format(n=n), "-link": "link status: UP\n", "-net_health": "net health status: Success\n",
            "-netdetect": "netdetect address: 10.0.0.1\n", "-gateway": "default gateway:10.0.0.1, Iface:eth0\n",
            "-ip": f"ipaddr:10.0.0.1{n}\nnetmask:255.255.255.0\n", "-vnic": f"vnic ipaddr:192.168.2.{n}\n"}


class FakeHost:
    """hccn_tool and npu-smi as a host answers them; `answers[n][flag]` overrides, `lost` the
    (device, target) pings that go unanswered, `outputs[(n, flag)]` whole Outputs."""

    def __init__(self, devices, smi=NPU_SMI_A2, tools=("hccn_tool", "npu-smi")):
        self.answers = {n: a2_answers(n) for n in devices}
        self.smi, self.tools, self.lost, self.outputs, self.calls = smi, tools, set(), {}, []

    def which(self, name, mode=None, path=None):
        return f"/usr/local/Ascend/driver/tools/{name}" if name in self.tools else None

    def run(self, argv, timeout_s):
        self.calls.append((list(argv), timeout_s))
        if argv[0].endswith("npu-smi"):
            return Output(0, self.smi)
        n, flag = int(argv[2]), argv[3]
        if (n, flag) in self.outputs:
            return self.outputs[(n, flag)]
        if flag in ("-ping", "-hccs_ping"):
            target = argv[-1]
            return Output(0, (PING_LOST if (n, target) in self.lost else PING_OK).format(n=n, ip=target))
        return Output(0, self.answers[n][flag])

    def pings(self):
        return [(int(argv[2]), argv[3], argv[-1]) for argv, _ in self.calls if argv[3:4] in (["-ping"], ["-hccs_ping"])]


@pytest.fixture
def hccn_conf(tmp_path):
    path = tmp_path / "hccn.conf"
    path.write_text("".join(f"address_{n}=10.0.0.1{n}\nnetmask_{n}=255.255.255.0\nnetdetect_{n}=10.0.0.1\n"
                            for n in range(8)))
    return str(path)


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_a2_node_passes_and_every_npu_pings_its_neighbour_and_the_peers(hccn_conf):
    host = FakeHost(range(8))
    checks = by_name(npu_link_checks(range(8), ["10.0.1.10"], run=host.run, which=host.which, hccn_conf=hccn_conf))
    assert set(checks) == {"npu series", "npu lldp", "npu link", "npu net_health", "npu netdetect", "npu gateway",
                           "npu ip", "npu ping"}
    assert all(c.status == OK for c in checks.values()), checks
    assert checks["npu series"].detail.startswith("A2 (npu-smi")
    assert checks["npu link"].detail == "8/8 UP" and checks["npu ping"].detail.startswith("16/16 answered (0% loss) [each NPU -> the next one here and 1 peer")
    pings = host.pings()
    assert sorted(pings) == sorted([(n, "-ping", f"10.0.0.1{(n + 1) % 8}") for n in range(8)]
                                   + [(n, "-ping", "10.0.1.10") for n in range(8)])
    assert all(0 < timeout <= npu_links.PING_TIMEOUT_S for _, timeout in host.calls)
    queried = {(int(argv[2]), argv[3]) for argv, _ in host.calls if argv[-1] == "-g"}
    assert queried == {(n, flag) for n in range(8) for flag in ("-lldp", "-link", "-net_health", "-netdetect",
                                                                  "-gateway", "-ip")}


@pytest.mark.parametrize("peers, blocking", [([], WARN), (["10.0.1.10"], FAIL)])
def test_faults_name_their_npus_and_block_only_a_multi_node_start(hccn_conf, peers, blocking):
    host = FakeHost(range(8))
    host.answers[3]["-link"] = "link status: DOWN\n"
    host.answers[5]["-net_health"] = "net health status: Fault\n"
    host.answers[2]["-ip"] = "ipaddr:10.0.0.99\nnetmask:255.255.255.0\n"
    host.answers[6]["-lldp"] = ""
    host.answers[4]["-gateway"] = "default gateway:, Iface:\n"
    host.lost.add((1, "10.0.0.12"))
    checks = by_name(npu_link_checks(range(8), peers, run=host.run, which=host.which, hccn_conf=hccn_conf))
    assert checks["npu link"].status == blocking and checks["npu link"].detail == "npu3 DOWN (1 of 8)"
    assert checks["npu net_health"].status == blocking and "npu5 Fault" in checks["npu net_health"].detail
    assert checks["npu ip"].status == blocking
    assert "npu2 10.0.0.99, /etc/hccn.conf says 10.0.0.12" in checks["npu ip"].detail
    assert checks["npu ping"].status == blocking
    assert "npu1->10.0.0.12 100% packet loss" in checks["npu ping"].detail
    # not blocking even for a multi-node start
    assert checks["npu lldp"].status == WARN and "npu6 no LLDP neighbour" in checks["npu lldp"].detail
    assert checks["npu gateway"].status == WARN and "npu4 no gateway" in checks["npu gateway"].detail
    assert checks["npu netdetect"].status == OK


def test_a3_checks_vnic_addresses_and_hccs_pings_them(tmp_path):
    host = FakeHost(range(16), smi=NPU_SMI_A3)
    checks = by_name(npu_link_checks(range(16), run=host.run, which=host.which, hccn_conf=str(tmp_path / "none")))
    assert checks["npu series"].detail.startswith("A3 (npu-smi: Ascend910_93)")
    assert "npu vnic" in checks and "npu ip" not in checks and checks["npu vnic"].status == OK
    assert checks["npu hccs_ping"].status == OK
    assert sorted(host.pings()) == sorted((n, "-hccs_ping", f"192.168.2.{(n + 1) % 16}") for n in range(16))


def test_the_series_follows_the_npu_count_without_npu_smi(hccn_conf):
    host = FakeHost(range(16), tools=("hccn_tool",))
    assert by_name(npu_link_checks(range(16), run=host.run, which=host.which,
                                   hccn_conf=hccn_conf))["npu series"].detail.startswith("A3 (16 NPUs)")
    host = FakeHost(range(8), tools=("hccn_tool",))
    assert by_name(npu_link_checks(range(8), run=host.run, which=host.which,
                                   hccn_conf=hccn_conf))["npu series"].detail.startswith("A2 (8 NPUs)")


def test_checks_that_cannot_run_say_why(tmp_path):
    host = FakeHost(range(8))
    (check,) = npu_link_checks([], run=host.run, which=host.which)
    assert check.status == SKIP and "no /dev/davinci" in check.detail
    (check,) = npu_link_checks(range(8), run=host.run, which=FakeHost(range(8), tools=()).which)
    assert check.status == SKIP and "hccn_tool not found" in check.detail
    assert host.calls == []
    for n in range(8):  # no address anywhere: nothing to ping
        host.answers[n]["-ip"] = "ipaddr:\nnetmask:\n"
    checks = by_name(npu_link_checks(range(8), run=host.run, which=host.which, hccn_conf=str(tmp_path / "none")))
    assert checks["npu ping"].status == SKIP and "no address to ping" in checks["npu ping"].detail
    assert checks["npu ip"].status == WARN and f"no {tmp_path / 'none'} (on a container" in checks["npu ip"].detail


def test_a_hung_or_failing_hccn_tool_is_a_finding_not_a_crash(hccn_conf):
    host = FakeHost(range(8))
    host.outputs[(4, "-link")] = Output(TIMED_OUT, "hccn_tool: no answer in 10 s")
    host.outputs[(0, "-net_health")] = Output(1, "Command execute failed!\n")
    checks = by_name(npu_link_checks(range(8), ["10.0.1.10"], run=host.run, which=host.which, hccn_conf=hccn_conf))
    assert checks["npu link"].status == FAIL and "npu4 hccn_tool -link -g: hccn_tool: no answer in 10 s" \
        in checks["npu link"].detail
    assert "npu0 hccn_tool -net_health -g: Command execute failed!" in checks["npu net_health"].detail


def test_ping_statistics():
    assert parse_ping(PING_OK.format(n=0, ip="1.2.3.4")) == (True, "0% packet loss")
    assert parse_ping("3 packets transmitted, 2 received, 33.33% packet loss") == (False, "33.33% packet loss")
    assert parse_ping("recv time out seq=0\n") == (False, "no answer (recv time out)")
    assert parse_ping("") == (False, "no ping statistics")


# ---- CUDA ----------------------------------------------------------------------------------------

NVIDIA_SMI = """Thu Dec  4 18:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
"""
TOPO = """\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tSYS\tPIX\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tSYS\tSYS\t0-47\t0\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPIX\tPIX\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
"""


class FakeSmi:
    def __init__(self, cuda="13.0", code=0, present=True):
        self.cuda, self.code, self.present, self.calls = cuda, code, present, []

    def which(self, name, mode=None, path=None):
        return "/usr/bin/nvidia-smi" if self.present and name == "nvidia-smi" else None

    def run(self, argv, timeout_s):
        self.calls.append(list(argv))
        assert timeout_s > 0
        if self.code:
            return Output(self.code, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
        if argv[1:] == ["topo", "-m"]:
            return Output(0, TOPO)
        if argv[1:2] == ["--query-gpu=name"]:
            return Output(0, "NVIDIA H200\n" * 4)
        return Output(0, NVIDIA_SMI.format(cuda=self.cuda))


FOUND = {"torch_cuda": "13.0", "cuda": 4, "nccl": "2.29.7", "p2p_missing": [], "versions": {"torch": "2.13.0"}}


def test_a_cuda_host_ready_for_tensor_parallelism():
    smi = FakeSmi()
    checks = by_name(cuda_link_checks(FOUND, "cuda", run=smi.run, which=smi.which))
    assert [c.status for c in checks.values()] == [OK, OK, OK], checks
    assert checks["cuda driver"].detail == ("driver 580.65.06 (runs CUDA <= 13.0), 4 x NVIDIA H200; "
                                            "torch built for CUDA 13.0")
    assert checks["nccl"].detail == "NCCL 2.29.7 (loaded by torch 2.13.0)"
    assert checks["cuda p2p"].detail == "4 GPUs, every pair has peer access (NV18, SYS)"


@pytest.mark.parametrize("want, status", [("cuda", FAIL), ("auto", WARN)])
def test_a_driver_older_than_torch_s_cuda_blocks_a_cuda_host(want, status):
    smi = FakeSmi(cuda="12.8")
    check = by_name(cuda_link_checks(FOUND, want, run=smi.run, which=smi.which))["cuda driver"]
    assert check.status == status and "too old" in check.detail and "CUDA <= 12.8" in check.detail
    smi = FakeSmi(code=9)
    check = by_name(cuda_link_checks(FOUND, want, run=smi.run, which=smi.which))["cuda driver"]
    assert check.status == status and "couldn't communicate with the NVIDIA driver" in check.detail
    smi = FakeSmi(cuda="13.0")  # torch on a newer minor than the driver runs: compatible
    check = by_name(cuda_link_checks({**FOUND, "torch_cuda": "13.2"}, want, run=smi.run, which=smi.which))["cuda driver"]
    assert check.status == OK and "minor-version compatibility" in check.detail


def test_gpu_pairs_without_peer_access_are_named_with_their_link():
    smi = FakeSmi()
    found = {**FOUND, "p2p_missing": [[0, 3], [3, 0], [1, 3], [3, 1], [2, 3]]}
    check = by_name(cuda_link_checks(found, "cuda", run=smi.run, which=smi.which))["cuda p2p"]
    assert check.status == WARN
    assert check.detail.startswith("3 of 6 GPU pairs without peer access: GPU0<->GPU3 (SYS), GPU1<->GPU3 (SYS), "
                                   "GPU2<->GPU3 (SYS)")


def test_cuda_checks_that_cannot_run_say_why():
    smi = FakeSmi(present=False)
    cpu_torch = {"torch_cuda": None, "cuda": 0, "versions": {"torch": "2.13.0+cpu"}}
    checks = by_name(cuda_link_checks(cpu_torch, "cuda", run=smi.run, which=smi.which))
    assert [c.status for c in checks.values()] == [SKIP, SKIP, SKIP]
    assert "nvidia-smi not found" in checks["cuda driver"].detail
    assert "not a CUDA build" in checks["nccl"].detail and "0 GPU(s)" in checks["cuda p2p"].detail
    assert smi.calls == []
    no_nccl = {**FOUND, "cuda": 1, "nccl_error": "RuntimeError: NCCL not built"}
    del no_nccl["nccl"]
    checks = by_name(cuda_link_checks(no_nccl, "cuda", run=FakeSmi().run, which=FakeSmi().which))
    assert checks["nccl"].status == WARN and "NCCL not built" in checks["nccl"].detail
    assert checks["cuda p2p"].status == SKIP


def test_topology_matrix():
    links = parse_topo(TOPO)
    assert links[(0, 1)] == "NV18" and links[(3, 0)] == "SYS" and links[(2, 3)] == "SYS"
    assert (0, 0) not in links and len(links) == 12


# ---- the real runner -------------------------------------------------------------------------------

def test_every_command_has_a_deadline_and_a_missing_tool_is_an_answer():
    start = time.monotonic()
    out = run_tool(["sleep", "10"], 0.3)
    assert out.code == TIMED_OUT and "no answer in 0.3 s" in out.text and time.monotonic() - start < 5
    assert run_tool(["/nonexistent/hccn_tool", "-i", "0"], 5).code == NOT_FOUND
    out = run_tool(["sh", "-c", "echo link status: UP; exit 3"], 5)
    assert out == Output(3, "link status: UP\n") and out.last_line() == "link status: UP"
