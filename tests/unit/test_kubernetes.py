"""deploy/kubernetes and the etcd examples of packaging/systemd, checked without a cluster or a network.

Every overlay (and the base) is rendered by a small kustomize of our own (tests/kube.py), and by
`kubectl kustomize` where kubectl is installed: both must agree. Each rendered object is
validated against the Kubernetes 1.30 API schemas (kubernetes-validate, strict: unknown fields
fail; the LeaderWorkerSet against the fields of its Go types). Then every pod the workloads would
make (each StatefulSet ordinal, each LWS worker index) gets the environment Kubernetes would give
it, and its `ascendserve` command line goes through our own parsers: `ascendserve --role ...` as
cli.py parses and config.load builds it, `ascendserve launch ...` as launch/dp.py resolves it
(the pod's ASCENDSERVE_NODE_RANK included), down to each rank's own command line. What the
configs must then say (etcd registry, every address bound and the pod IP advertised, the token
from the Secret, each pod's ranks and their coverage of the data-parallel deployment, names that
resolve to deployed Services, probes) is checked per overlay, and a set of broken manifests
shows that each check can fail.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from ascendserve import __version__
from ascendserve.flags import ENGINE_ROLES
from tests.kube import (NAMESPACE, SECRETS, Launch, Pod, RenderError, by_id, command_line, container_env, expand,
                        parse_launch, parse_role, pods, render, split_image, validate)

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
TREES = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
DEVICE_TAG = {"ascend": "npu", "cuda": "cuda"}  # overlay -> the release's device; others: cpu
ACCELERATORS = ("huawei.com/Ascend910", "nvidia.com/gpu")
TOKEN = SECRETS["ascendserve-cluster", "token"]
WILDCARDS = ("0.0.0.0", "::")


# --- the checks ---------------------------------------------------------------------------

SECRET_FLAGS = ("--cluster-token", "--registry-password", "--api-key")


@dataclass
class Instance:
    pod: Pod
    container: dict
    config: object
    launch: Launch | None = None


class Check:
    """Everything the rendered objects must satisfy; `problems` lists what they do not."""

    def __init__(self, objects: list[dict], tmp: Path, moe: bool = False):
        self.objects, self.tmp, self.moe = objects, tmp, moe
        self.ids = by_id(objects)
        self.configmaps = {n: o for (k, n), o in self.ids.items() if k == "ConfigMap"}
        # the Secret as the docs have it created: the etcd password only where etcd has a user
        registry = self.configmaps.get("ascendserve-registry", {}).get("data", {})
        self.etcd_auth = bool(registry.get("ASCENDSERVE_REGISTRY_USERNAME"))
        self.secrets = {k: v for k, v in SECRETS.items() if k[1] != "etcd-password" or self.etcd_auth}
        self.problems: list[str] = []
        self.instances: list[Instance] = []
        for pod in pods(objects):
            for container in pod.spec["containers"]:
                try:
                    self._container(pod, container)
                except AssertionError as exc:
                    self.problems.append(f"{pod.where} container {container['name']}: {exc}")
        for check in (self._unique_ids, self._kv_connectors, self._dp_groups):
            try:
                check()
            except AssertionError as exc:
                self.problems.append(str(exc))

    def _models(self, value: str) -> str:
        """/models/NAME -> a directory of the test's with a config.json (MoE when self.moe)."""
        if not value.startswith("/models/"):
            return value
        path = self.tmp / "models" / value[len("/models/"):]
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8} if self.moe else \
            {"architectures": ["Qwen2_5_VLForConditionalGeneration"]}
        (path / "config.json").write_text(json.dumps(cfg))
        return str(path)

    def _container(self, pod: Pod, c: dict) -> None:
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in c, f"no {probe}"
        env = container_env(pod, c, self.configmaps, self.secrets)
        argv = command_line(c, env)
        if split_image(c["image"])[0] != "ascendserve":
            assert argv is None, "runs ascendserve from another image"
            return
        assert argv is not None, "the ascendserve image runs no ascendserve command"
        for secret in SECRETS.values():
            assert not any(secret in a for a in argv), "a Secret's value is in argv (visible in ps)"
        assert not [a for a in argv if a.split("=")[0] in SECRET_FLAGS], "a secret flag is in argv: use its env twin"
        env = {k: self._models(v) for k, v in env.items()}
        argv = [self._models(a) for a in argv]
        role = pod.labels["app.kubernetes.io/component"]
        if argv[:1] == ["launch"]:
            launch = parse_launch(argv[1:], env, pod.name)
            start, local = launch.args.dp_rank_start, launch.args.dp_size_local
            assert start == pod.index * local, \
                f"pod index {pod.index} runs ranks from {start}, not {pod.index} x {local}"
            for _, config in launch.ranks:  # the probes ask local rank 0
                self._config(pod, c, config, role, launch.args.tp_size * launch.args.dp_size_local,
                             launch.args.engine_port)
            self.instances += [Instance(pod, c, config, launch) for _, config in launch.ranks]
        else:
            config = parse_role(argv, env, pod.name)
            self._config(pod, c, config, role, config.engine.tensor_parallel_size, config.server.port)
            self.instances.append(Instance(pod, c, config))

    def _config(self, pod: Pod, c: dict, config, role: str, devices: int, probe_port: int) -> None:
        assert config.role == role, f"runs role {config.role} in a pod labelled {role}"
        assert config.cluster.token == TOKEN, "no cluster token from the Secret"
        assert config.registry.backend == "etcd", f"registry backend {config.registry.backend}"
        assert config.registry.password == self.secrets.get(("ascendserve-cluster", "etcd-password"), ""), \
            "the etcd password is not the Secret's"
        for url in config.registry.endpoints:
            self._resolves(urlsplit(url).hostname, urlsplit(url).port, "registry endpoint")
        # every address, the pod's loopback included: kubectl port-forward connects there
        assert config.server.host in WILDCARDS, \
            f"binds {config.server.host}: kubectl port-forward (the pod's loopback) cannot reach it"
        if role == "proxy":
            assert ",".join(config.proxy.api_keys) == SECRETS["ascendserve-cluster", "api-keys"], "no API keys"
        else:  # what peers and the registry get, as config.load derives cluster.advertise_host
            assert config.cluster.advertise_host == pod.ip, \
                f"advertises {config.cluster.advertise_host!r}, not the pod IP {pod.ip}"
        ports = {p["containerPort"]: p.get("name") for p in c.get("ports", [])}
        assert config.server.port in ports, f"serves on {config.server.port}, not a container port {sorted(ports)}"
        ready = c["readinessProbe"].get("httpGet", {})
        assert ready.get("path") == "/health", f"readiness probe {ready}"
        assert ready.get("port") in (probe_port, ports.get(probe_port)), \
            f"the readiness probe asks port {ready.get('port')}, not {probe_port}"
        live = c["livenessProbe"].get("httpGet", {})
        # the proxy's /health is 503 until the engines are ready: a liveness probe there restarts it
        assert live.get("path") == ("/healthcheck" if role == "proxy" else "/health"), f"liveness probe {live}"
        if config.is_engine or role == "elastic-server":
            start = c.get("startupProbe", {})
            allowed = start.get("periodSeconds", 10) * start.get("failureThreshold", 3) if start else \
                c["livenessProbe"].get("initialDelaySeconds", 0)
            assert allowed >= 600, f"{allowed} s to load the model before the liveness probe may kill it"
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert config.model.path.startswith(str(self.tmp / "models")), f"model {config.model.path}"
            assert mounts.get("/models", {}).get("readOnly"), "/models is not mounted read-only"
        if config.is_engine:
            if config.role in ("prefill", "decode"):
                assert config.kv.port in ports, f"KV side channel {config.kv.port} is not a container port"
            if config.kv_events.enabled:
                assert config.kv_events.host not in ("127.0.0.1", "localhost"), \
                    "KV events on loopback: proxies in other pods cannot follow them"
            for source in config.netloader.sources:
                if source != "auto":  # auto: the seeds etcd knows
                    self._resolves(*source.rsplit(":", 1), "NetLoader seed")
            if config.ec.connector == "store":
                self._resolves(*config.ec.store_url.rsplit(":", 1), "EC store")
            limits = c.get("resources", {}).get("limits", {})
            for name in ACCELERATORS:
                if name in limits:
                    assert int(limits[name]) == devices, f"{limits[name]} x {name} for {devices} ranks' devices"
            if config.engine.data_parallel_size > 1:
                self._resolves(config.engine.data_parallel_address, None, "DP master", before_ready=True)

    def _resolves(self, host: str, port, what: str, before_ready: bool = False) -> None:
        """A name in this namespace: a Service (with `port`), or POD.SERVICE of a StatefulSet / LWS
        behind its headless Service (published before ready when peers need it to start)."""
        parts = host.split(".")
        if len(parts) > 1 and parts[-1] in ("svc", "local") or len(parts) > 3:
            return  # a fully qualified name: not ours to check
        if len(parts) == 3 and parts[2] != NAMESPACE:
            return  # another namespace
        if len(parts) == 1:
            svc = self.ids.get(("Service", host))
            assert svc is not None, f"{what} {host}: no such Service is deployed"
            assert port is None or int(port) in [p["port"] for p in svc["spec"]["ports"]], \
                f"{what} {host}:{port}: the Service has no such port"
            return
        pod, service = parts[0], parts[1]
        lws = self.ids.get(("LeaderWorkerSet", service))
        if lws is not None:
            assert re.fullmatch(rf"{service}-\d+(-\d+)?", pod), f"{what} {host}: no such pod of {service}"
            return
        sets = [o for (k, _), o in self.ids.items() if k == "StatefulSet" and o["spec"]["serviceName"] == service]
        assert sets, f"{what} {host}: no StatefulSet behind Service {service}"
        ordinals = range(sets[0]["spec"].get("replicas", 1))
        assert pod in [f"{sets[0]['metadata']['name']}-{i}" for i in ordinals], f"{what} {host}: no such pod"
        svc = self.ids.get(("Service", service))
        assert svc is not None and svc["spec"].get("clusterIP") == "None", f"{what} {host}: no headless Service"
        if before_ready:
            assert svc["spec"].get("publishNotReadyAddresses"), \
                f"{what} {host}: Service {service} publishes its pods only once ready"

    def _unique_ids(self) -> None:
        ids = [i.config.instance_id for i in self.instances if i.config.role != "proxy"]
        dupes = sorted({x for x in ids if ids.count(x) > 1})
        assert not dupes, f"instance ids registered twice: {dupes}"

    def _kv_connectors(self) -> None:
        kinds = {i.config.kv.connector for i in self.instances if i.config.role in ("prefill", "decode")}
        assert len(kinds) <= 1, f"prefill and decode use different KV connectors: {kinds}"

    def _dp_groups(self) -> None:
        groups: dict[str, list[Instance]] = {}
        for i in self.instances:
            if i.launch is not None:
                groups.setdefault(i.pod.group, []).append(i)
        for group, members in groups.items():
            ranks = sorted(r for i in members for r, c in i.launch.ranks if c is i.config)
            size = members[0].launch.args.dp_size
            assert ranks == list(range(size)), f"{group}: the pods run DP ranks {ranks} of --dp-size {size}"
            masters = {i.launch.args.dp_address for i in members}
            assert len(masters) == 1, f"{group}: the pods disagree on the DP master: {masters}"
            leader = min(members, key=lambda i: i.launch.args.dp_rank_start).pod
            master = masters.pop().split(".")[0]
            assert master == leader.name, f"{group}: DP master {master}, but rank 0 runs in {leader.name}"


def rendered(tree: str) -> list[dict]:
    return render(KUBE / tree)


def checked(tree_or_objects, tmp: Path, moe: bool = False) -> Check:
    objects = rendered(tree_or_objects) if isinstance(tree_or_objects, str) else tree_or_objects
    return Check(objects, tmp, moe)


# --- the tests ------------------------------------------------------------------------------

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def _kubectl(path: Path) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _kustomization(tmp: Path, **fields) -> Path:
    """A kustomization of the user's own in tmp; paths in `fields` relative to deploy/kubernetes
    (kustomize takes no absolute ones)."""
    rel = os.path.relpath(KUBE, tmp)
    fields = {k: [f"{rel}/{p}" for p in v] if k in ("resources", "components") else v for k, v in fields.items()}
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **fields}))
    return tmp


def _composed(tmp: Path, components: list[str]) -> Path:
    """The base and several components, as a user composes them."""
    return _kustomization(tmp, resources=["base"], components=[f"components/{c}" for c in components])


COMPOSED = ["dp", "cuda", "loadbalancer"], ["lws", "ascend", "external-etcd"]


def test_every_component_has_its_overlay():
    assert sorted(p.name for p in (KUBE / "components").iterdir()) == OVERLAYS
    assert {"external-etcd", "lws", "ascend", "cuda", "dp"} <= set(OVERLAYS)


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_our_renderer_agrees_with_kubectl(tree):
    assert by_id(render(KUBE / tree)) == by_id(_kubectl(KUBE / tree))


@pytest.mark.parametrize("components", COMPOSED, ids="+".join)
def test_components_compose(tmp_path, components):
    (tmp_path / "user").mkdir()
    root = _composed(tmp_path / "user", components)
    objects = render(root)
    if shutil.which("kubectl"):
        assert by_id(objects) == by_id(_kubectl(root))
    check = checked(objects, tmp_path)
    assert check.problems == []


@pytest.mark.parametrize("tree", TREES)
def test_objects_validate_against_the_api(tree):
    for obj in rendered(tree):
        validate(obj)


@pytest.mark.parametrize("tree", TREES)
def test_commands_parse_with_our_cli(tmp_path, tree):
    check = checked(tree, tmp_path)
    assert check.problems == []
    roles = {i.config.role for i in check.instances}
    assert roles == {*ENGINE_ROLES, "proxy", "metaserver", "elastic-server"}  # pd: replicas 0, still checked


@pytest.mark.parametrize("tree", ["overlays/dp", "overlays/lws"])
def test_data_parallel_ranks_cover_the_deployment(tmp_path, tree):
    """A MoE model: each rank a vLLM DP rank of the whole deployment, rank 0's pod the master."""
    check = checked(tree, tmp_path, moe=True)
    assert check.problems == []
    ranks = [(i.pod.name, i.config.engine.data_parallel_rank, i.config.server.port)
             for i in check.instances if i.launch is not None]
    assert [r for _, r, _ in sorted(ranks, key=lambda x: x[1])] == [0, 1, 2, 3]
    assert {i.config.engine.data_parallel_size for i in check.instances if i.launch} == {4}
    assert len({p for p, _, _ in ranks}) == 2  # two pods of two ranks each
    assert {port for _, _, port in ranks} == {8300, 8301}
    # launch/dp.resolve with the pod's environment: ASCENDSERVE_NODE_RANK is the pod's index
    # (StatefulSet ordinal, LWS worker index), and the rank start node rank x --dp-size-local
    starts = {(i.pod.name, i.pod.index, i.launch.args.node_rank, i.launch.args.dp_rank_start)
              for i in check.instances if i.launch is not None}
    assert sorted(s[1:] for s in starts) == [(0, 0, 0), (1, 1, 2)], starts


def test_registry_is_the_etcd_members_of_the_base(tmp_path):
    ids = by_id(rendered("base"))
    etcd = ids["StatefulSet", "etcd"]
    members = [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]
    assert len(members) == 3 and etcd["spec"]["serviceName"] == "etcd"
    assert ids["Service", "etcd"]["spec"]["clusterIP"] == "None"
    args = dict(a.split("=", 1) for a in etcd["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args["--initial-cluster"] == ",".join(f"{m}=http://{m}.etcd:2380" for m in members)
    for m in members:  # each member's own view, $(POD_NAME) expanded as the kubelet does
        assert expand(args["--initial-advertise-peer-urls"], {"POD_NAME": m}) == f"http://{m}.etcd:2380"
        assert expand(args["--advertise-client-urls"], {"POD_NAME": m}) == f"http://{m}.etcd:2379"
    endpoints = ids["ConfigMap", "ascendserve-registry"]["data"]["ASCENDSERVE_REGISTRY_ENDPOINTS"]
    assert endpoints.split(",") == [f"http://{m}.etcd:2379" for m in members]
    assert etcd["spec"]["template"]["spec"]["containers"][0]["image"].startswith("quay.io/coreos/etcd:v3.5.")


def test_external_etcd_removes_ours_and_points_elsewhere(tmp_path):
    objects = rendered("overlays/external-etcd")
    assert not [o for o in objects if o["metadata"]["name"] == "etcd"]
    check = checked(objects, tmp_path)
    assert check.problems == []
    endpoints = {tuple(i.config.registry.endpoints) for i in check.instances}
    assert len(endpoints) == 1 and not any(".etcd:" in e for e in endpoints.pop())


@pytest.mark.parametrize("tree", TREES)
def test_images_are_this_release(tree):
    device = DEVICE_TAG.get(tree.rpartition("/")[2], "cpu")
    images = {c["image"] for p in pods(rendered(tree)) for c in p.spec["containers"]}
    ours = {i for i in images if split_image(i)[0] == "ascendserve"}
    assert ours == {f"ascendserve:{__version__}-{device}"}


@pytest.mark.parametrize("overlay, resource", [("ascend", "huawei.com/Ascend910"), ("cuda", "nvidia.com/gpu")])
def test_accelerator_overlays_give_every_engine_devices(tmp_path, overlay, resource):
    check = checked(f"overlays/{overlay}", tmp_path)
    assert check.problems == []
    engines = [i for i in check.instances if i.config.is_engine]
    assert engines and all(resource in i.container["resources"]["limits"] for i in engines)
    others = [i for i in check.instances if not i.config.is_engine]
    assert others and not any(resource in i.container.get("resources", {}).get("limits", {}) for i in others)


def test_the_secret_keys_are_the_documented_ones():
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    for name, key in SECRETS:
        assert f"generic {name}" in doc and f"--from-literal={key}=" in doc, (name, key)
    refs = {(v["valueFrom"]["secretKeyRef"]["name"], v["valueFrom"]["secretKeyRef"]["key"])
            for tree in TREES for p in pods(rendered(tree)) for c in p.spec["containers"]
            for v in c.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})}
    assert refs == set(SECRETS)


def test_the_proxy_liveness_route_exists():
    """The route the proxies' liveness probe asks answers whatever the engines do."""
    source = (REPO / "ascendserve" / "router" / "app.py").read_text()
    assert '@get("/healthcheck")' in source


# --- the checks catch broken manifests ---------------------------------------------------------

def _container(objects: list[dict], kind: str, name: str) -> dict:
    return by_id(objects)[kind, name]["spec"]["template"]["spec"]["containers"][0]


def _lws_container(objects: list[dict]) -> dict:
    return by_id(objects)["LeaderWorkerSet", "decode"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"][
        "containers"][0]


def _drop_env(c: dict, name: str) -> None:
    assert any(v["name"] == name for v in c["env"]), name
    c["env"] = [v for v in c["env"] if v["name"] != name]


def _set_env(c: dict, name: str, **value) -> None:
    (var,) = [v for v in c["env"] if v["name"] == name]
    var.pop("value", None), var.pop("valueFrom", None)
    var.update(value)


def _drop_flag(args: list[str], flag: str) -> None:
    i = args.index(flag)
    del args[i:i + 2]


def _set_flag(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def _in_a_shell(c: dict) -> None:
    """What the manifests did before `launch --node-rank`: a shell computes the rank start."""
    script = " ".join(["exec", *c["command"], *c["args"], '--dp-rank-start "$((POD_INDEX * 2))"'])
    c["command"], c["args"] = ["/bin/sh", "-c"], [script]
    c["env"].append({"name": "POD_INDEX", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}})
    _drop_env(c, "ASCENDSERVE_NODE_RANK")


def _broken(tmp_path, tree: str, edit) -> list[str]:
    objects = copy.deepcopy(rendered(tree))
    edit(objects)
    return checked(objects, tmp_path).problems


@pytest.mark.parametrize("edit, expected", [
    (lambda o: _container(o, "StatefulSet", "prefill")["args"].__setitem__(-2, "--netloader-sorce"),
     "rejected by the command line parser"),
    (lambda o: _container(o, "Deployment", "proxy")["args"].extend(["--cluster-token", "$(ASCENDSERVE_CLUSTER_TOKEN)"]),
     "in argv"),
    (lambda o: _drop_env(_container(o, "StatefulSet", "decode"), "ASCENDSERVE_ADVERTISE_HOST"),
     "advertises 'decode-0', not the pod IP"),
    (lambda o: _set_env(_container(o, "Deployment", "metaserver"), "ASCENDSERVE_HOST",
                        valueFrom={"fieldRef": {"fieldPath": "status.podIP"}}), "kubectl port-forward"),
    (lambda o: _drop_flag(_container(o, "StatefulSet", "prefill")["args"], "--kv-events-host"), "KV events on loopback"),
    (lambda o: _container(o, "Deployment", "encoder")["envFrom"].pop(), "model.path is required"),
    (lambda o: _container(o, "Deployment", "proxy")["livenessProbe"]["httpGet"].__setitem__("path", "/health"),
     "liveness probe"),
    (lambda o: _container(o, "StatefulSet", "prefill").pop("startupProbe"), "to load the model"),
    (lambda o: _container(o, "Deployment", "metaserver")["envFrom"][0]["configMapRef"].__setitem__("name", "nope"),
     "is not deployed"),
    (lambda o: by_id(o)["ConfigMap", "ascendserve-registry"]["data"].__setitem__(
        "ASCENDSERVE_REGISTRY_ENDPOINTS", "http://etcd-3.etcd:2379"), "no such pod"),
    (lambda o: _container(o, "StatefulSet", "prefill")["args"].__setitem__(
        slice(-4, -2), ["--ec-store-url", "memcache:11211"]), "no such Service"),
    (lambda o: _container(o, "StatefulSet", "decode")["args"].__setitem__(7, "example"),
     "different KV connectors"),
    (lambda o: _drop_env(_container(o, "Deployment", "elastic-server"), "ASCENDSERVE_CLUSTER_TOKEN"), "cluster.token"),
], ids=["flag typo", "token in argv", "advertises host name", "binds the pod IP", "KV events on loopback", "no model",
        "proxy liveness on /health", "no startup allowance", "missing ConfigMap", "etcd member not deployed",
        "EC store name", "KV connectors differ", "seed without token"])
def test_broken_manifests_are_rejected(tmp_path, edit, expected):
    problems = _broken(tmp_path, "base", edit)
    assert problems and any(expected in p for p in problems), problems


@pytest.mark.parametrize("tree, edit, expected", [
    ("overlays/dp", lambda o: by_id(o)["StatefulSet", "decode"]["spec"].__setitem__("replicas", 3),
     "do not fit in --dp-size"),
    ("overlays/dp", lambda o: by_id(o)["StatefulSet", "decode"]["spec"].__setitem__("replicas", 1),
     "the pods run DP ranks [0, 1] of --dp-size 4"),
    ("overlays/dp", lambda o: _set_flag(_container(o, "StatefulSet", "decode")["args"], "--dp-address",
                                        "decode-1.decode"), "DP master decode-1"),
    ("overlays/dp", lambda o: by_id(o)["Service", "decode"]["spec"].pop("publishNotReadyAddresses"),
     "publishes its pods only once ready"),
    ("overlays/dp", lambda o: _drop_env(_container(o, "StatefulSet", "decode"), "ASCENDSERVE_NODE_RANK"),
     "pod index 1 runs ranks from 0, not 1 x 2"),
    ("overlays/lws", lambda o: _drop_env(_lws_container(o), "ASCENDSERVE_NODE_RANK"),
     "pod decode-0-1 container engine: pod index 1 runs ranks from 0"),
    ("overlays/lws", lambda o: _set_env(_lws_container(o), "ASCENDSERVE_NODE_RANK", value="$(LWS_WORKER_IDX)"),
     "--node-rank (ASCENDSERVE_NODE_RANK) must be an integer"),
    ("overlays/dp", lambda o: _container(o, "StatefulSet", "decode")["args"].extend(["--dp-rank-start", "0"]),
     "launch: --node-rank 1 needs --dp-size-local"),
    ("overlays/cuda", lambda o: _container(o, "StatefulSet", "decode")["resources"]["limits"].__setitem__(
        "nvidia.com/gpu", "2"), "ranks' devices"),
    ("overlays/dp", lambda o: _in_a_shell(_container(o, "StatefulSet", "decode")),
     "the ascendserve image runs no ascendserve command"),
], ids=["more pods than ranks", "fewer pods than ranks", "master not rank 0", "master unresolvable before ready",
        "ranks from no index", "LWS ranks from no index", "LWS index misspelled", "rank start set twice",
        "devices != tp x local ranks", "ascendserve in a shell"])
def test_broken_layouts_are_rejected(tmp_path, tree, edit, expected):
    objects = copy.deepcopy(rendered(tree))
    edit(objects)
    problems = Check(objects, tmp_path, moe=True).problems
    assert problems and any(expected in p for p in problems), problems


@pytest.mark.parametrize("edit", [
    lambda o: by_id(o)["StatefulSet", "decode"]["spec"].__setitem__("replicas", "two"),
    lambda o: by_id(o)["Deployment", "proxy"]["spec"]["template"]["spec"].__setitem__(
        "contaners", by_id(o)["Deployment", "proxy"]["spec"]["template"]["spec"].pop("containers")),
    lambda o: _container(o, "StatefulSet", "etcd")["ports"][0].__setitem__("containerPort", "2379"),
    lambda o: _container(o, "Deployment", "metaserver")["env"].append({"name": "X", "value": 4}),
], ids=["replicas a string", "misspelled field", "port a string", "env value a number"])
def test_schema_violations_are_rejected(edit):
    import jsonschema

    objects = copy.deepcopy(rendered("base"))
    edit(objects)
    with pytest.raises(jsonschema.ValidationError):
        for obj in objects:
            validate(obj)


def test_lws_envelope_violations_are_rejected():
    import jsonschema

    lws = copy.deepcopy(by_id(rendered("overlays/lws"))["LeaderWorkerSet", "decode"])
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)


@pytest.mark.parametrize("fields, error", [
    ({"patches": [{"patch": "apiVersion: v1\nkind: Service\nmetadata: {name: nope}\n"}]}, "no resource matches"),
    ({"namePrefix": "x-"}, "does not implement"),
    ({"components": ["base"]}, "Component belongs"),
    ({"patches": [{"patch": "- {op: add, path: /spec/x/y, value: 1}", "target": {"kind": "Service"}}]},
     "no such parent"),
])
def test_renderer_refuses_what_it_does_not_do(tmp_path, fields, error):
    with pytest.raises(RenderError, match=error):
        render(_kustomization(tmp_path, resources=["base"], **fields))


def test_expansion_follows_the_kubelet():
    env = {"A": "1", "POD_INDEX": "2"}
    assert expand("$(A)-$(B)-$$(A)-$((POD_INDEX * 2))-$A", env) == "1-$(B)-$(A)-$((POD_INDEX * 2))-$A"


# --- packaging/systemd: etcd beside our units -------------------------------------------------

SYSTEMD = REPO / "packaging" / "systemd"
DROP_IN = SYSTEMD / "ascendserve@.service.d" / "etcd.conf.example"
ETCD_DEFAULTS = SYSTEMD / "default" / "etcd.example"


def test_only_units_lie_where_install_sh_takes_units():
    """install.sh copies every file of systemd/ into /etc/systemd/system: the examples live in
    folders, which it skips, and reach the tarball with the rest (build.sh copies the tree)."""
    assert sorted(p.name for p in SYSTEMD.iterdir() if p.is_file()) == ["ascendserve.target", "ascendserve@.service"]
    assert DROP_IN.is_file() and ETCD_DEFAULTS.is_file()
    assert 'cp -r "$HERE/packaging/systemd" "$TREE/systemd"' in (REPO / "build.sh").read_text()


def _env_file(path: Path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {k: v.strip('"') for k, v in pairs}


def test_etcd_defaults_describe_a_three_member_cluster():
    env = _env_file(ETCD_DEFAULTS)
    members = dict(m.split("=", 1) for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert len(members) == 3 and env["ETCD_NAME"] in members
    assert members[env["ETCD_NAME"]] == env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]
    assert env["ETCD_INITIAL_CLUSTER_STATE"] == "new"
    own_host = urlsplit(env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]).hostname
    assert urlsplit(env["ETCD_ADVERTISE_CLIENT_URLS"]).hostname == own_host
    readme = (REPO / "packaging" / "README.md").read_text()
    for url in members.values():  # the README's [registry] endpoints are these members' client URLs
        assert f'"{url.replace(":2380", ":2379")}"' in readme


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd not installed (Debian: etcd-server)")
def test_etcd_knows_every_variable_of_the_defaults():
    done = subprocess.run(["etcd", "--help"], capture_output=True, text=True, timeout=30)
    flags = set(re.findall(r"--([a-z0-9-]+)", done.stdout + done.stderr))
    for key in _env_file(ETCD_DEFAULTS):
        assert key.startswith("ETCD_") and key[5:].lower().replace("_", "-") in flags, key


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing (Debian: systemd)")
@pytest.mark.parametrize("broken", [False, True])
def test_drop_in_verifies_with_our_unit(tmp_path, broken):
    """systemd-analyze verify of ascendserve@proxy.service with the drop-in installed as
    ascendserve@.service.d/etcd.conf (user scope, as tests/unit/test_packaging.py does)."""
    stub = tmp_path / "ascendserve"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    unit = (SYSTEMD / "ascendserve@.service").read_text().replace("/opt/ascendserve/current/bin/ascendserve", str(stub))
    (tmp_path / "ascendserve@proxy.service").write_text(unit)
    (tmp_path / "etcd.service").write_text("[Service]\nExecStart=/bin/true\n")
    drop_in = DROP_IN.read_text()
    if broken:
        drop_in = drop_in.replace("After=etcd.service", "Afterr=etcd.service")
    (tmp_path / "ascendserve@.service.d").mkdir()
    (tmp_path / "ascendserve@.service.d" / "etcd.conf").write_text(drop_in)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "HOME": str(tmp_path / "home")}
    for d in ("run", "home"):
        (tmp_path / d).mkdir(mode=0o700)
    done = subprocess.run(["systemd-analyze", "--user", "verify", "--man=no", str(tmp_path / "ascendserve@proxy.service")],
                          capture_output=True, text=True, timeout=60, env=env)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "etcd.conf" in line or "ascendserve@" in line]
    assert bool(done.returncode != 0 or complaints) == broken, done.stdout + done.stderr
    directives = dict(line.split("=", 1) for line in DROP_IN.read_text().splitlines()
                      if "=" in line and not line.startswith("#"))
    assert directives == {"Wants": "etcd.service", "After": "etcd.service"}
