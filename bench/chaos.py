"""Chaos: an E -> P -> D cluster under steady load while engine instances are SIGKILLed and restarted.

    python -m bench.chaos [--kills 12] [--interval 10] [--target main|group|worker|mixed]
                          [--encoders 2 --prefills 2 --decodes 2] [--concurrency 4] [--deadline 120]

Cluster (tiny random Qwen2.5-VL, float32, 127.0.0.1): a metaserver; encoders,
prefills and decodes that register with it (--metaserver-url, --cluster-token);
a proxy that learns them from the registry. KV goes P -> D over the pull
connector (P frees blocks no D pulled after --kv-ttl), EC goes E -> P over the
host's shm region (a pin lapses after [ec] pin_ttl_s). Each instance is pinned
to one core (VLLM_CPU_OMP_THREADS_BIND) with a 256 MiB KV cache. Serving
instances run at autogroup nice 10 so that a restart (nice 0) is not starved by
vLLM's busy-polling workers on a 2-core host; the metaserver drops an
instance after 20 s without a heartbeat (6 s by default: too tight when 2
cores are this busy; a killed instance is ejected by the proxy well before).

Load: `concurrency` clients, each sending one request after another: text
completions (streaming) and chats (text or one image, streaming or not; half
of the images repeat, so the proxy skips the encoder for them). Every request
asks for exactly `max_tokens` tokens (ignore_eos) and has a client deadline.

Chaos: each kill takes the next role of a shuffled E/P/D cycle and a random
instance of it, waits (up to 20 s) until the proxy has a request on it, and
SIGKILLs it: `main` its role process (`kill -9 PID`: vLLM's engine core and
worker must follow), `group` every process of the instance at once (a
container or cgroup kill: multiprocessing's resource tracker too, so nothing
unlinks vLLM's shared memory but the restarted instance), `worker` its vLLM
worker (the largest process, the OOM killer's pick: the instance must exit
non-zero by itself), `mixed` the three in turn. All of the instance's
processes must be gone within 60 s ("orphans"); the same argv is started again
on the same ports; once it is ready, the /dev/shm segments the killed
processes mapped must be gone or in use by a live process ("shm left by killed
instances"). The next kill is due `interval` seconds after the proxy
re-admitted the instance. `--per-wave N` kills N instances 2 s apart and
restarts them together (the CI test: one per role).

Outcome of each request: ok (200 and all `max_tokens` tokens, [DONE] for a
stream); explicit (an HTTP error with an OpenAI error body, or an SSE error
event); other (anything else: a truncated stream, a 200 with fewer tokens, a
5xx without a body, a dropped connection); hung (past the client deadline).
An explicit failure is "failed-explicit" only if the proxy's log names the
killed instance for it (x-request-id: a hop that failed, or the backend of
the stream) and the request was in flight when it was killed or was sent to
it while it was dying (between the kill and the last of its processes
exiting: a killed worker leaves the API server answering with an error for a
moment); every other failure is "failed-other".

At the end: the load stops; the proxy must hold no request; within
kv_ttl + pin_ttl + 30 s every P and D must be back to vllm:kv_cache_usage_perc
0 and P to 0 ascendserve:kv_blocks_held_remote, and the EC region must hold no
pinned or half-written entry (connectors/ec/region.snapshot); then every
instance must exit 0 on SIGTERM and no /dev/shm segment any of the cluster's
processes mapped may be left. The exit status is 1 unless every count marked
"must be 0" is 0. Results go to bench/results/chaos-*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from ascendserve.connectors.ec.region import snapshot
from ascendserve.launch.children import kill_group
from bench._chaos_cluster import (ROLES, SHORT, Cluster, Settings, alive, port_of, tree_pids, tree_shm, unused,
                                  yield_to_starts)
from bench._chaos_load import Load, Record
from tests.procs import PYTHON, Proc, kv_usage, plain_vllm, start_all, wait_for

TARGETS = ("main", "group", "worker")
# vLLM's worker can take ~20 s to notice its dead engine core on a busy host (its shutdown holds the GIL)
ORPHAN_AFTER_S = 60.0
SHM_PREFIXES = ("psm_", "vllm_dist_", "asf-", "sem.mp-")
MUST_BE_ZERO = ("failed-explicit", "failed-other", "hung", "differs", "orphans", "shm_after_kills", "restart_failures",
                "silent_engine_deaths",
                "leaked_kv", "leaked_ec", "leaked_shm", "unclean_stops")


@dataclass
class Kill:
    role: str
    name: str
    port: int
    target: str
    at: float
    dead_s: float = 0.0
    ready_s: float = 0.0
    admitted_s: float = 0.0
    orphans: list = field(default_factory=list)
    exit_code: int | None = None
    busy: int = 0  # requests the proxy had on it right before the kill
    hit: int = 0  # requests in flight on it at the kill, by the proxy's log
    segments: list = field(default_factory=list)
    shm_left: list = field(default_factory=list)
    restart_error: str = ""


def victim_pid(proc: Proc, target: str) -> int:
    if target == "worker":
        kids = [p for p in proc.descendants() if "Worker" in " ".join(p.cmdline())]
        if kids:
            return max(kids, key=lambda p: p.memory_info().rss).pid
    return proc.popen.pid


def kill(cluster: Cluster, role: str, proc: Proc, target: str, log) -> Kill:
    """SIGKILL, then wait (bounded) for the instance's processes to go."""
    pids = tree_pids(proc)
    segments = set(tree_shm(proc))
    cluster.seen_shm |= segments
    k = Kill(role, proc.name, proc.port, target, time.monotonic())
    if target == "group":
        os.killpg(proc.popen.pid, signal.SIGKILL)
    else:
        os.kill(victim_pid(proc, target), signal.SIGKILL)
    deadline = k.at + ORPHAN_AFTER_S
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    k.orphans = [p for p in pids if alive(p)]
    k.dead_s = time.monotonic() - k.at
    if k.orphans:
        log(f"    ORPHANS of {proc.name}: {k.orphans} still alive {ORPHAN_AFTER_S:.0f} s after the kill; killing them")
    kill_group(proc.popen.pid, grace_s=0.0, tracker_grace_s=10.0)
    k.exit_code = proc.popen.wait(30)
    k.segments = sorted(segments)
    return k


def shm_left(k: Kill, wait_s: float = 15.0) -> list[str]:
    """The killed instance's segments that nobody uses and nobody removed (bounded wait)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = unused(set(k.segments))
        if not left or time.monotonic() > deadline:
            return sorted(left)
        time.sleep(0.5)


def restart(cluster: Cluster, procs: list[Proc], kills: list[Kill]) -> None:
    """The same argv on the same ports, all at once; ready, then re-admitted by the proxy."""
    for proc in procs:
        proc.stop(timeout=1)
        proc.start()
    for proc, k in zip(procs, kills):
        try:
            proc.wait_ready(max(1.0, k.at + 400 - time.monotonic()))
            k.ready_s = time.monotonic() - k.at
            yield_to_starts(proc)
        except (RuntimeError, TimeoutError) as exc:
            k.restart_error = str(exc).splitlines()[0][:300]
    for proc, k in zip(procs, kills):
        if k.restart_error:
            continue
        try:
            wait_for(lambda: cluster.admitted(proc), 120, f"the proxy never re-admitted {proc.name}")
            k.admitted_s = time.monotonic() - k.at
        except AssertionError as exc:
            k.restart_error = str(exc)[:300]
    for k in kills:  # by now the multiprocessing tracker or the restarted instance removed them
        k.shm_left = shm_left(k)
    cluster.note_shm()


def run_kills(cluster: Cluster, s: Settings, log) -> list[Kill]:
    rng = random.Random(s.seed + 1)
    kills: list[Kill] = []
    cycle: list[str] = []
    while len(kills) < s.kills:
        time.sleep(s.interval_s)
        wave: list[tuple[Proc, Kill]] = []
        for _ in range(min(s.per_wave, s.kills - len(kills))):
            if not cycle:
                cycle = list(s.kill_roles)
                rng.shuffle(cycle)
            role = cycle.pop()
            proc = rng.choice([p for p in cluster.engines[role] if p not in [w[0] for w in wave]])
            target = TARGETS[len(kills) % len(TARGETS)] if s.target == "mixed" else s.target
            if wave:
                time.sleep(2.0)
            busy = cluster.wait_busy(proc)  # kill it while the proxy has a request on it
            k = kill(cluster, role, proc, target, log)
            k.busy = busy
            wave.append((proc, k))
            kills.append(k)
        restart(cluster, [w[0] for w in wave], [w[1] for w in wave])
        for proc, k in wave:
            log(f"  kill {kills.index(k) + 1}/{s.kills}: {proc.name} ({k.role}, {k.target}) gone in {k.dead_s:.1f} s, "
                f"ready in {k.ready_s:.0f} s, admitted in {k.admitted_s:.0f} s; orphans {len(k.orphans)}, "
                f"shm left {k.shm_left or 0}" + (f"; RESTART FAILED: {k.restart_error}" if k.restart_error else ""))
        if any(k.restart_error for _, k in wave):
            break
    return kills


# ---- verdict ---------------------------------------------------------------------------------
def proxy_hops(proxy: Proc) -> dict[str, set[int]]:
    """request id -> ports of the instances the proxy's log names for it."""
    hops: dict[str, set[int]] = {}
    for line in proxy.log_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        rid = e.get("request_id")
        for key in ("url", "backend"):
            if rid and isinstance(e.get(key), str) and re.search(r":\d+/?$", e[key]):
                hops.setdefault(rid, set()).add(port_of(e[key]))
    return hops


def classify(records: list[Record], kills: list[Kill], proxy: Proc) -> dict:
    hops = proxy_hops(proxy)
    counts = {"ok": 0, "failed-explicit": 0, "failed-other": 0, "hung": 0}
    bad, explicit = [], []
    for r in records:
        if r.outcome == "ok":
            counts["ok"] += 1
            continue
        if r.outcome == "hung":
            counts["hung"] += 1
            bad.append(r)
            continue
        # in flight on it when it was killed, or sent to it while it was dying (a killed worker leaves
        # its API server answering, with an error, until the instance is gone: k.dead_s)
        on_killed = any(k.port in hops.get(r.rid, ()) and (r.start <= k.at <= r.end
                                                          or k.at <= r.start <= k.at + k.dead_s) for k in kills)
        if r.outcome == "explicit" and on_killed:
            counts["failed-explicit"] += 1
            explicit.append(r)
        else:
            counts["failed-other"] += 1
            bad.append(r)
    for k in kills:
        k.hit = sum(1 for r in records if r.start <= k.at <= r.end and k.port in hops.get(r.rid, ()))
    latencies = sorted(r.end - r.start for r in records if r.outcome == "ok")
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else [0.0] * 99

    def brief(r: Record) -> dict:
        return {"rid": r.rid, "kind": r.kind, "outcome": r.outcome, "detail": r.detail,
                "hops": sorted(hops.get(r.rid, ()))}

    return {**counts, "p50_s": q[49], "p99_s": q[98], "bad": [brief(r) for r in bad[:20]],
            "explicit": [brief(r) for r in explicit[:20]]}


def metric_sum(proc: Proc, name: str) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)$", text, re.M))


def held(cluster: Cluster) -> dict:
    up = [p for p in cluster.all_engines() if p.popen.poll() is None and p.role != "encoder"]
    kv = {p.name: kv_usage(p) for p in up}
    remote = sum(metric_sum(p, "ascendserve:kv_blocks_held_remote") for p in up if p.role == "prefill")
    ec = snapshot(cluster.shm_name) or {"held": 0}
    return {"kv_usage": kv, "kv_held_remote": remote, "ec_held": ec["held"]}


def settle(cluster: Cluster, s: Settings, log) -> dict:
    """Wait (bounded) until nothing is held, and say what still is."""
    wait_for(lambda: cluster.in_flight() == 0, 60, "the proxy still counts requests in flight after the load")
    deadline = time.monotonic() + max(s.kv_ttl_s, s.pin_ttl_s) + 30
    while True:
        now = held(cluster)
        clear = not any(now["kv_usage"].values()) and not now["kv_held_remote"] and not now["ec_held"]
        if clear or time.monotonic() > deadline:
            log(f"  held at the end: {now}")
            return now
        time.sleep(1)


def run(s: Settings, log=print) -> dict:
    """The whole experiment; returns the report (the cluster is stopped when it returns)."""
    s.log_dir.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir("/dev/shm"))
    cluster = Cluster(s)
    kills: list[Kill] = []
    load = None
    started = time.monotonic()
    try:
        cluster.start()
        rss = sum(p.memory_info().rss for proc in cluster.procs()
                  for p in [psutil.Process(proc.popen.pid), *proc.descendants()]) / 2**30
        log(f"  cluster up in {time.monotonic() - started:.0f} s: {', '.join(p.name for p in cluster.all_engines())}"
            f", {rss:.1f} GiB RSS")
        load = Load(cluster.proxy.url, str(s.model), s).start()
        kills = run_kills(cluster, s, log)
        time.sleep(s.interval_s)
        load.stop()
        log(f"  load stopped: {len(load.records)} requests")
        end = settle(cluster, s, log)
        cluster.note_shm()
        verdict = classify(load.records, kills, cluster.proxy)
    finally:
        if load is not None and load._thread.is_alive():
            load._stop.set()
        codes = cluster.stop()
    time.sleep(2)
    differs = compare_with_oracle(s, load.records, log) if load is not None else []
    left = unused(cluster.seen_shm)
    new_unknown = sorted(unused({n for n in set(os.listdir("/dev/shm")) - before - cluster.seen_shm
                                 if n.startswith(SHM_PREFIXES)}))
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items()},
        "wall_s": time.monotonic() - started,
        "kills": [vars(k) for k in kills],
        "kills_per_role": {r: sum(k.role == r for k in kills) for r in ROLES},
        "requests": len(load.records), **verdict, "held": end,
        "compared": sum(r.ids is not None for r in load.records), "differs": len(differs),
        "differing": differs[:10], **migration_gaps(cluster.proxy.log_path),
        "leaked_kv": sum(1 for v in end["kv_usage"].values() if v) + int(end["kv_held_remote"]),
        "leaked_ec": int(end["ec_held"]),
        "orphans": sum(len(k.orphans) for k in kills),
        "shm_after_kills": sum(len(k.shm_left) for k in kills),
        "restart_failures": sum(bool(k.restart_error) for k in kills),
        # an instance whose engine died must exit non-zero (systemd restarts on failure only)
        "silent_engine_deaths": sum(k.target == "worker" and k.exit_code == 0 for k in kills),
        "unclean_stops": {n: c for n, c in codes.items() if c != 0},
        "leaked_shm": sorted(left), "unattributed_new_shm": new_unknown,
    }
    report["passed"] = not any(report[k] for k in MUST_BE_ZERO)
    return report


def migration_gaps(proxy_log: Path) -> dict:
    """From the proxy's log: requests continued elsewhere, and from each failure to the next token
    the client got (router/migrate.py logs both)."""
    gaps, moved = [], 0
    for line in proxy_log.read_text(errors="replace").splitlines():
        if '"request migrated"' in line:
            moved += 1
        elif '"migration resumed"' in line:
            gaps.append(json.loads(line)["gap_ms"] / 1000)
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [gaps[0] if gaps else float("nan")] * 99
    return {"migrations": moved, "gap_p50_s": q[49], "gap_p99_s": q[98], "gaps_s": gaps}


def compare_with_oracle(s, records, log) -> list[dict]:
    """Every answer's token ids against one plain vLLM instance's for the same request (started
    once the cluster has stopped; each distinct request is asked once)."""
    answered = [r for r in records if r.outcome == "ok" and r.ids is not None]
    if not answered:
        return []
    oracle = plain_vllm(s.model, s.log_dir, name="oracle")
    oracle.memory_wanted = lambda: 0.0  # the cluster's reservation covers it: the cluster is gone
    differs, want = [], {}
    try:
        start_all(oracle)
        for r in answered:
            body = {k: v for k, v in r.body.items() if k not in ("stream", "stream_options")}
            key = json.dumps([r.path, body], sort_keys=True)
            if key not in want:
                reply = httpx.post(oracle.url + r.path, json=body, timeout=300)
                want[key] = reply.json()["choices"][0]["token_ids"] if reply.status_code == 200 else reply.text
            if r.ids != want[key]:
                differs.append({"rid": r.rid, "kind": r.kind, "ours": r.ids, "oracle": want[key]})
    finally:
        oracle.stop()
    log(f"  {len(answered)} answers compared with plain vLLM ({len(want)} distinct requests): {len(differs)} differ")
    return differs


def print_report(r: dict) -> str:
    from bench._report import table

    per_role = " ".join(f"{SHORT[k]}={v}" for k, v in r["kills_per_role"].items())
    rows = [["kills (per role)", f"{len(r['kills'])} ({per_role})", ""],
            ["kill target", r["settings"]["target"], ""],
            ["kills with requests in flight on the victim", sum(k["hit"] > 0 for k in r["kills"]), ""],
            ["requests", r["requests"], ""],
            ["ok", r["ok"], ""],
            ["failed-explicit (in flight on the killed instance)", r["failed-explicit"], "must be 0"],
            ["failed-other", r["failed-other"], "must be 0"],
            ["hung", r["hung"], "must be 0"],
            ["answers compared with plain vLLM / differing", f"{r['compared']} / {r['differs']}", "must be 0"],
            ["migrations; failure -> next token p50 / p99 (s)",
             f"{r['migrations']}; {r['gap_p50_s']:.2f} / {r['gap_p99_s']:.2f}", ""],
            ["latency p50 / p99 (ok, s)", f"{r['p50_s']:.2f} / {r['p99_s']:.2f}", ""],
            ["orphan processes after kills", r["orphans"], "must be 0"],
            ["shm left by killed instances", r["shm_after_kills"], "must be 0"],
            ["restart failures", r["restart_failures"], "must be 0"],
            ["worker kills the instance exited 0 after", r["silent_engine_deaths"], "must be 0"],
            ["KV held at the end (instances + blocks)", r["leaked_kv"], "must be 0"],
            ["EC entries held at the end", r["leaked_ec"], "must be 0"],
            ["shm segments leaked at the end", len(r["leaked_shm"]), "must be 0"],
            ["instances not exiting 0 on SIGTERM at the end", len(r["unclean_stops"]), "must be 0"],
            ["verdict", "PASS" if r["passed"] else "FAIL", ""]]
    text = table(f"chaos: {r['settings']['counts']} under load, {r['wall_s']:.0f} s", ["", "value", ""], rows)
    table("kills", ["#", "instance", "role", "target", "in flight", "gone s", "ready s", "admitted s", "exit",
                    "orphans", "shm left"],
          [[i + 1, k["name"], k["role"], k["target"], k["hit"], round(k["dead_s"], 1), round(k["ready_s"]),
            round(k["admitted_s"]), k["exit_code"], len(k["orphans"]), len(k["shm_left"])]
           for i, k in enumerate(r["kills"])])
    for b in r["explicit"]:
        print("  failed explicitly, in flight on a killed instance:", b)
    for b in r["bad"]:
        print("  bad request:", b)
    if r["leaked_shm"]:
        print("  leaked shm:", r["leaked_shm"])
    if r["unattributed_new_shm"]:
        print("  new unmapped shm not seen in our processes (other users of this host?):", r["unattributed_new_shm"])
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a VL model directory (default: build the tiny one)")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp") / f"ascendserve-chaos-{os.getpid()}")
    ap.add_argument("--kills", type=int, default=12)
    ap.add_argument("--interval", type=float, default=10.0,
                    help="seconds of load between re-admission and the next kill")
    ap.add_argument("--target", choices=[*TARGETS, "mixed"], default="mixed")
    ap.add_argument("--encoders", type=int, default=2)
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--kv-ttl", type=float, default=10.0)
    ap.add_argument("--pin-ttl", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-wave", type=int, default=1, help="kills at once (2 s apart), restarted together")
    a = ap.parse_args()
    a.log_dir.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        import subprocess

        model = a.log_dir / "tiny-vl"
        if not model.exists():
            subprocess.run([PYTHON, "-m", "ascendserve", "model", "tiny", "--kind", "vl", "--out", str(model)],
                           check=True, capture_output=True)
    s = Settings(model=model, log_dir=a.log_dir, counts={"encoder": a.encoders, "prefill": a.prefills,
                                                         "decode": a.decodes},
                 kills=a.kills, interval_s=a.interval, target=a.target, concurrency=a.concurrency,
                 deadline_s=a.deadline, max_tokens=a.max_tokens, kv_ttl_s=a.kv_ttl, pin_ttl_s=a.pin_ttl, seed=a.seed,
                 per_wave=a.per_wave)
    print(f"chaos: logs in {a.log_dir}", flush=True)
    report = run(s, log=lambda m: print(m, flush=True))
    print_report(report)
    from bench._report import save

    save("chaos", report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
