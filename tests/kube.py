"""Kubernetes without a cluster, for tests/unit/test_kubernetes.py: a small kustomize, the API
schemas, the pods a workload makes and what Kubernetes puts in their containers, and
ascendserve's own parsers applied to their command lines.

- `render(root)`: the objects `kubectl kustomize root` prints, for exactly the features
  deploy/kubernetes uses (resources, components, strategic-merge and JSON patches with
  targets, images); anything else raises RenderError rather than rendering wrongly.
- `validate(obj)`: the Kubernetes 1.30 schemas (kubernetes-validate, strict); a LeaderWorkerSet
  against the fields of its Go types, its pod templates as PodTemplates.
- `pods(objects)`: every pod the workloads would make (each StatefulSet ordinal, each LWS worker
  index) with its index, labels, IP and what a controller injects; `container_env` the
  environment the kubelet gives a container (downward API values sampled, Secrets from SECRETS,
  ConfigMaps from the rendered ones, $(VAR) expanded as the kubelet does it);
  `command_line` its `ascendserve` argv.
- `parse_role`, `parse_launch`: that argv as cli.py and launch/dp.py read it, up to the loaded
  config, down to each DP rank's own command line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import yaml

from ascendserve.config import ConfigError, load
from ascendserve.flags import ROLES, flags_for

K8S_VERSION = "1.30.0"  # the oldest API these manifests are checked against (pod-index label: >= 1.28)
NAMESPACE = "default"
SECRETS = {  # (Secret, key) -> the test's value; docs/kubernetes.md says how to create each
    ("ascendserve-cluster", "token"): "k8s-test-token-5b0c2f1e9d8a7b6c5d4e3f2a1b0c9d8e",
    ("ascendserve-cluster", "etcd-password"): "k8s-test-etcd-password",  # only for an etcd with auth
    ("ascendserve-cluster", "api-keys"): "sk-test-one,sk-test-two",
}


# --- a kustomize for the features deploy/kubernetes uses -------------------------------------

class RenderError(Exception):
    pass


BUILTIN_GROUPS = {"v1", "apps/v1", "policy/v1", "networking.k8s.io/v1", "batch/v1"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name"}
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images"}


def render(root: Path) -> list[dict]:
    """The objects `kubectl kustomize root` prints (in another order)."""
    return _build(root, [], component=False)


def _build(root: Path, objects: list[dict], component: bool) -> list[dict]:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    if unknown := set(k) - KUSTOMIZATION_FIELDS:
        raise RenderError(f"{root}: fields this renderer does not implement: {sorted(unknown)}")
    if (k.get("kind") == "Component") != component:
        raise RenderError(f"{root}: a {k.get('kind', 'Kustomization')} where a "
                          f"{'Component' if component else 'Kustomization'} belongs")
    objects = list(objects)
    for entry in k.get("resources", []):
        path = root / entry
        if path.is_dir():
            objects += _build(path, [], component=False)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for entry in k.get("components", []):
        objects = _build(root / entry, objects, component=True)
    for entry in k.get("patches", []):
        objects = _patch(root, objects, entry)
    for entry in k.get("images", []):
        for obj in objects:
            _set_image(obj, entry)
    return objects


def _selected(obj: dict, target: dict) -> bool:
    if unknown := set(target) - {"kind", "name", "labelSelector"}:
        raise RenderError(f"target fields this renderer does not implement: {sorted(unknown)}")
    labels = obj["metadata"].get("labels", {})
    for term in filter(None, target.get("labelSelector", "").split(",")):
        key, eq, value = term.partition("=")
        if not eq or key.endswith("!"):
            raise RenderError(f"label selector {term!r}: only key=value is implemented")
        if labels.get(key.strip()) != value.strip():
            return False
    return all(target.get(f) in (None, v) for f, v in (("kind", obj["kind"]), ("name", obj["metadata"]["name"])))


def _patch(root: Path, objects: list[dict], entry: dict) -> list[dict]:
    body = yaml.safe_load((root / entry["path"]).read_text() if "path" in entry else entry["patch"])
    target = entry.get("target")
    if isinstance(body, list):  # JSON 6902
        if target is None:
            raise RenderError("a JSON patch needs a target")
        for obj in objects:
            if _selected(obj, target):
                _json_patch(obj, body)
        return objects
    explicit = target is None
    target = target or {"kind": body["kind"], "name": body["metadata"]["name"]}
    matched = [i for i, obj in enumerate(objects) if _selected(obj, target)]
    if explicit and not matched:
        raise RenderError(f"no resource matches the patch of {target['kind']}/{target['name']}")
    if body.get("$patch") == "delete":
        return [obj for i, obj in enumerate(objects) if i not in matched]
    body = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
    body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k != "name"}
    for i in matched:
        if objects[i]["apiVersion"] not in BUILTIN_GROUPS:
            raise RenderError(f"strategic merge on {objects[i]['kind']}: use a JSON patch on custom resources")
        objects[i] = _merge(objects[i], body)
    return objects


def _merge(orig, patch):
    if not (isinstance(orig, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    out = dict(orig)
    for key, value in patch.items():
        if key.startswith("$"):
            raise RenderError(f"patch directive {key} is not implemented here")
        if value is None:
            out.pop(key, None)
        elif key in out and isinstance(value, list) and (merge_key := _list_key(key, out[key], value)):
            by_key = {item[merge_key]: item for item in out[key]}
            merged = [_merge(by_key[i[merge_key]], i) if i[merge_key] in by_key else i for i in value]
            done = {i[merge_key] for i in value}  # kustomize: the patch's items first, then the rest
            out[key] = merged + [i for i in out[key] if i[merge_key] not in done]
        else:
            out[key] = _merge(out[key], value) if key in out else copy.deepcopy(value)
    return out


def _list_key(field_name: str, orig, patch) -> str | None:
    if not isinstance(orig, list):
        return None
    items = [*orig, *patch]
    if not all(isinstance(i, dict) for i in items):
        return None
    if field_name == "ports":
        return next((k for k in ("containerPort", "port") if all(k in i for i in items)), None)
    return MERGE_KEYS.get(field_name)


def _json_patch(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = doc
        try:
            for p in parents:
                node = node[int(p)] if isinstance(node, list) else node[p]
        except (KeyError, IndexError, ValueError):
            raise RenderError(f"{op['path']}: no such parent") from None
        if op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif op["op"] in ("add", "replace"):
            value = copy.deepcopy(op["value"])
            if isinstance(node, list):
                index = len(node) if last == "-" else int(last)
                node.insert(index, value) if op["op"] == "add" else node.__setitem__(index, value)
            elif op["op"] == "replace" and last not in node:
                raise RenderError(f"{op['path']}: nothing to replace")
            else:
                node[last] = value
        else:
            raise RenderError(f"JSON patch op {op['op']!r} is not implemented")


def split_image(image: str) -> tuple[str, str]:
    name, _, tag = image.rpartition(":")
    return (image, "") if not name or "/" in tag else (name, tag)


def _set_image(node, entry: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    name, tag = split_image(c.get("image", ""))
                    if name == entry["name"]:
                        tag = entry.get("newTag", tag)
                        c["image"] = entry.get("newName", name) + (f":{tag}" if tag else "")
            else:
                _set_image(value, entry)
    elif isinstance(node, list):
        for item in node:
            _set_image(item, entry)


def by_id(objects: list[dict]) -> dict[tuple[str, str], dict]:
    ids = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"duplicate objects: {ids}"
    return dict(zip(ids, objects))


# --- the API schemas ---------------------------------------------------------------------------

def _lws_schema() -> dict:
    """The fields of leaderworkerset.x-k8s.io/v1 LeaderWorkerSet (lws api/leaderworkerset/v1,
    leaderworkerset_types.go) used or plausible here; pod templates are checked on their own."""
    def obj(props: dict, required=()) -> dict:
        return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}
    count = {"type": "integer", "minimum": 1}
    template = {"type": "object"}
    return obj({
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"}, "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object"},
        "spec": obj({
            "replicas": {"type": "integer", "minimum": 0},
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "rolloutStrategy": {"type": "object"},
            "networkConfig": obj({"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}),
            "leaderWorkerTemplate": obj({
                "size": count, "leaderTemplate": template, "workerTemplate": template,
                "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None",
                                           "Default"]},
                "subGroupPolicy": {"type": "object"}, "volumeClaimTemplates": {"type": "array"},
            }, required=["workerTemplate"]),
        }, required=["leaderWorkerTemplate"]),
    }, required=["apiVersion", "kind", "metadata", "spec"])


def validate(obj: dict) -> None:
    """Raises kubernetes_validate.ValidationError (or jsonschema's) for an invalid object."""
    import jsonschema
    import kubernetes_validate

    if obj["kind"] == "LeaderWorkerSet":
        jsonschema.validate(obj, _lws_schema())
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for part in ("leaderTemplate", "workerTemplate"):
            if part in lwt:
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": f"{obj['metadata']['name']}-{part}"},
                                              "template": lwt[part]}, K8S_VERSION, strict=True)
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- the pods the workloads make, and what Kubernetes puts in their containers ----------------

@dataclass
class Pod:
    workload: dict
    name: str
    ip: str
    labels: dict
    spec: dict
    group: str  # pods of one data-parallel deployment share it
    index: int  # the StatefulSet ordinal, the LWS worker index (a Deployment's: its replica number)
    env: dict = field(default_factory=dict)  # what a controller injects (LWS), ahead of the container's own

    @property
    def where(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']} pod {self.name}"


def pods(objects: list[dict]) -> list[Pod]:
    out: list[Pod] = []

    def add(workload, name, template, group, index, labels=(), env=()):
        out.append(Pod(workload, name, f"10.244.{len(out) // 200}.{len(out) % 200 + 10}",
                       {**template["metadata"].get("labels", {}), **dict(labels)}, template["spec"], group,
                       index, dict(env)))

    for w in objects:
        name, spec = w["metadata"]["name"], w.get("spec", {})
        count = max(1, spec.get("replicas", 1))  # replicas 0: the template is still checked
        if w["kind"] == "Deployment":
            for i in range(count):
                add(w, f"{name}-5d9c7b8f6-x{i}", spec["template"], f"{name}-x{i}", i)
        elif w["kind"] == "StatefulSet":
            for i in range(count):
                add(w, f"{name}-{i}", spec["template"], name, i, {"apps.kubernetes.io/pod-index": str(i)})
        elif w["kind"] == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            size = lwt.get("size", 1)
            for g in range(count):
                for i in range(size):
                    template = lwt.get("leaderTemplate", lwt["workerTemplate"]) if i == 0 else lwt["workerTemplate"]
                    add(w, f"{name}-{g}" + (f"-{i}" if i else ""), template, f"{name}-{g}", i,
                        {"leaderworkerset.sigs.k8s.io/worker-index": str(i)},
                        {"LWS_LEADER_ADDRESS": f"{name}-{g}.{name}.{NAMESPACE}", "LWS_GROUP_SIZE": str(size),
                         "LWS_WORKER_INDEX": str(i)})
    return out


def expand(text: str, env: dict) -> str:
    """$(VAR) as the kubelet expands it (k8s.io/kubernetes third_party/forked/golang/expansion):
    $$ is a literal $, an unknown $(NAME) stays as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(" and (end := text.find(")", i + 2)) != -1:
                name = text[i + 2:end]
                out.append(env.get(name, f"$({name})"))
                i = end + 1
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def container_env(pod: Pod, container: dict, configmaps: dict[str, dict], secrets: dict) -> dict[str, str]:
    """The environment of `container` in `pod`; KeyError-free: problems raise AssertionError."""
    env = dict(pod.env)
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref is not None, f"envFrom {source}: only ConfigMaps are expected here"
        if ref["name"] not in configmaps:
            assert ref.get("optional"), f"envFrom ConfigMap {ref['name']} is not deployed"
            continue
        env.update(configmaps[ref["name"]].get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        src = var.get("valueFrom", {})
        if (f := src.get("fieldRef")) is not None:
            path = f["fieldPath"]
            label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
            values = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": pod.ip,
                      "spec.nodeName": "node-1", "status.hostIP": "192.0.2.1"}
            assert label or path in values, f"{var['name']}: fieldPath {path} is not sampled by this test"
            if label:
                assert label.group(1) in pod.labels, f"{var['name']}: the pod has no label {label.group(1)}"
            env[var["name"]] = pod.labels[label.group(1)] if label else values[path]
        elif (s := src.get("secretKeyRef")) is not None:
            key = (s["name"], s["key"])
            assert key in SECRETS, f"{var['name']}: Secret {key} is not one docs/kubernetes.md creates"
            assert key in secrets or s.get("optional"), f"{var['name']}: Secret {key} is required here"
            if key in secrets:
                env[var["name"]] = secrets[key]
        elif (c := src.get("configMapKeyRef")) is not None:
            data = configmaps.get(c["name"], {}).get("data", {})
            assert c["key"] in data or c.get("optional"), f"{var['name']}: ConfigMap key {c} is not deployed"
            if c["key"] in data:
                env[var["name"]] = data[c["key"]]
        else:
            raise AssertionError(f"{var['name']}: valueFrom {src} is not sampled by this test")
    return env


def command_line(container: dict, env: dict) -> list[str] | None:
    """The arguments `ascendserve` is called with, $(VAR) expanded; None when the container runs
    something else (a shell that would run ascendserve included: the manifests need none)."""
    argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    return argv[1:] if argv[:1] == ["ascendserve"] else None


# --- our own parsers ------------------------------------------------------------------------

@contextlib.contextmanager
def _usage_errors():
    """argparse's exit on a bad command line, as an AssertionError carrying its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as exc:
        raise AssertionError(f"rejected by the command line parser: {err.getvalue().strip()[-400:]}") from exc


def parse_role(argv: list[str], env: dict, hostname: str):
    """`ascendserve ARGV` as cli._run_role reads it, up to the loaded config."""
    from ascendserve.cli import _role_parser

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--role", choices=ROLES)
    with _usage_errors():
        known, _ = pre.parse_known_args(argv)
        args = _role_parser(known.role).parse_args(argv)
    flag_values = {f.dest: getattr(args, f.dest, None) for f in flags_for(None)}
    try:
        with mock.patch("socket.gethostname", return_value=hostname):
            return load(args.role, args.config, flag_values, env)
    except ConfigError as exc:
        raise AssertionError(f"config error: {exc}") from None


@dataclass
class Launch:
    args: argparse.Namespace
    ranks: list  # (global rank, Config) of each rank this pod starts


def parse_launch(argv: list[str], env: dict, hostname: str) -> Launch:
    """`ascendserve launch ARGV` as launch/dp.main reads it, and each rank's own command line."""
    from ascendserve.launch import dp

    with _usage_errors():
        args, passthrough = dp.parser().parse_known_args(argv)
    try:
        config = dp._role_config(args, env)
    except ConfigError as exc:
        raise AssertionError(f"launch: config error: {exc}") from None
    dp.resolve(args, config, env)  # ASCENDSERVE_NODE_RANK: the pod's index
    assert (error := dp._check(args)) is None, f"launch: {error}"
    moe = dp.is_moe(dp._model_path(args, config, env))
    children = dp.rank_children(args, passthrough, ["ascendserve"], env, "cpu", moe)
    ranks = [(args.dp_rank_start + i, parse_role(c.argv[1:], {**env, **c.env}, hostname))
             for i, c in enumerate(children)]
    return Launch(args, ranks)
