"""One typed configuration tree: defaults < TOML file < ASCENDSERVE_* env < flags.

Every value is checked against its field's type before the sources are
merged, so an error names the key, the bad value, where it came from, and
what is allowed. This is the only module that reads ``os.environ``.
"""

from __future__ import annotations

import os
import re
import shlex
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ascendserve.config_checks import finish
from ascendserve.config_schema import Config, ConfigError, _Section
from ascendserve.config_schema import ECConfig, KVConfig, ProxyConfig, ServerConfig  # noqa: F401 (callers' names)
from ascendserve.flags import ENV_PREFIX, FLAGS, Flag


def secrets(config: Config) -> list[str]:
    """This process's secret values (masked in every log line, never echoed)."""
    return [v for v in (config.cluster.token, config.proxy.backend_api_key, config.registry.password,
                        *config.proxy.api_keys) if v]


_SECRET_KEY = re.compile(r"(token|secret|password|api[-_]?key)", re.IGNORECASE)
REDACTED = "***"


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f: hints[f] for f in cls.__struct_fields__}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, _Section)


def _allowed(tp: Any) -> str:
    """Human description of a leaf type, for error messages."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *metas = typing.get_args(tp)
        bounds = []
        for m in metas:
            for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(m, attr, None) is not None:
                    bounds.append(f"{sym} {getattr(m, attr)}")
        return f"{_allowed(base)} {' and '.join(bounds)}".strip()
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_allowed(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    return getattr(tp, "__name__", str(tp))


def _check_leaf(key: str, value: Any, tp: Any, source: str, strict: bool) -> Any:
    try:
        return msgspec.convert(value, tp, strict=strict)
    except msgspec.ValidationError as exc:
        detail = str(exc).split(" - at ")[0]
        raise ConfigError(
            f"{key} = {value!r} ({source}) is invalid: {detail}; allowed: {_allowed(tp)}"
        ) from None


# Keys that existed once, and what replaced them.
_AFFINITY = ("the text-prefix affinity lost to KV-event-aware routing in bench/kv_routing.py; routing = 'kv' "
             "(the default) sends a prompt where the engines' KV events say its blocks are cached")
REMOVED = {"proxy.prefix_aware": _AFFINITY, "proxy.prefix_chars": _AFFINITY, "proxy.prefix_slack_tokens": _AFFINITY}


def _check_tree(raw: dict, cls: type, prefix: str, source: str) -> dict:
    """Validate a nested dict from a TOML file against the struct `cls`."""
    types = _field_types(cls)
    checked: dict[str, Any] = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        if key in REMOVED:
            raise ConfigError(f"{key} ({source}) was removed: {REMOVED[key]}")
        if name not in types:
            section = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise ConfigError(
                f"unknown key {key!r} ({source}); allowed keys in {section}: "
                + ", ".join(sorted(types))
            )
        tp = types[name]
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} ({source}) must be a table [{key}], got {value!r}")
            checked[name] = _check_tree(value, tp, key + ".", source)
        else:
            checked[name] = _check_leaf(key, value, tp, source, strict=True)
    return checked


def _leaf_type(key: str) -> Any:
    cls: Any = Config
    *sections, leaf = key.split(".")
    for s in sections:
        cls = _field_types(cls)[s]
    return _field_types(cls)[leaf]


def _set(tree: dict, key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    for s in sections:
        tree = tree.setdefault(s, {})
    tree[leaf] = value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} does not exist or is not a file")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    return _check_tree(raw, Config, "", f"from {path}")


def _from_strings(pairs: list[tuple[Flag, Any, str]]) -> dict:
    """Env and flag values arrive as strings (or lists/bools); convert loosely."""
    tree: dict = {}
    for flag, value, source in pairs:
        tp = _leaf_type(flag.key)
        if flag.repeatable and isinstance(value, str):
            value = shlex.split(value)
        if flag.many and isinstance(value, str):
            value = value.replace(",", " ").split()
        _set(tree, flag.key, _check_leaf(flag.key, value, tp, source, strict=False))
    return tree


def environ() -> dict[str, str]:
    """The process environment; the one sanctioned read of os.environ."""
    return dict(os.environ)


def load(
    role: str | None,
    config_file: str | None,
    flag_values: dict[str, Any],
    env: dict[str, str] | None = None,
) -> Config:
    """Build the effective config. `flag_values` maps Flag.dest to parsed values
    (None or absent = not given). Raises ConfigError with an operator message."""
    env = environ() if env is None else env
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    file_tree = _load_file(config_file) if config_file else {}
    env_pairs = [(f, env[f.env], f"from ${f.env}") for f in FLAGS if env.get(f.env) not in (None, "")]
    flag_pairs = [
        (f, flag_values[f.dest], f"from {f.name}")
        for f in FLAGS
        if flag_values.get(f.dest) not in (None, [], False)
    ]
    tree = _merge(_merge(file_tree, _from_strings(env_pairs)), _from_strings(flag_pairs))
    role = role or env.get(ENV_PREFIX + "ROLE") or tree.get("role")
    if role is not None:
        tree["role"] = _check_leaf("role", role, _field_types(Config)["role"], "role", strict=True)
    if flag_values.get("engine__vllm_args") and "engine" in file_tree:
        # Repeated --vllm-arg adds to the file's list rather than replacing it.
        tree["engine"]["vllm_args"] = file_tree["engine"].get("vllm_args", []) + tree["engine"]["vllm_args"]
    config = msgspec.convert(tree, Config)
    config.config_file = str(Path(config_file).resolve()) if config_file else ""
    return finish(config, env)


# Sections that mean something to each kind of role (the rest is noise in its log).
_SECTIONS = {
    "engine": {"role", "instance_id", "runtime_dir", "server", "model", "engine", "kv", "kv_events", "ec", "log",
               "cluster", "registry"},
    "proxy": {"role", "instance_id", "runtime_dir", "server", "log", "cluster", "proxy", "ec", "registry"},
    "metaserver": {"role", "instance_id", "runtime_dir", "server", "log", "cluster", "metaserver", "registry"},
}


def redacted(config: Config) -> dict:
    """The effective config as a dict, secret-looking values masked, limited to
    the sections this role uses."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (REDACTED if _SECRET_KEY.search(k) and v else walk(v)) for k, v in node.items()}
        if isinstance(node, list) and all(isinstance(x, str) for x in node):
            return redact_args(node)
        return node

    tree = msgspec.to_builtins(config)
    kind = "engine" if config.is_engine else config.role
    if kind in _SECTIONS:
        tree = {k: v for k, v in tree.items() if k in _SECTIONS[kind]}
    return walk(tree)


def redact_args(argv: list[str]) -> list[str]:
    """Mask the values of secret-looking options in an argument list
    (`--api-key=X` and `--api-key X` alike)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        secret = arg.startswith("--") and bool(_SECRET_KEY.search(arg.split("=", 1)[0]))
        if hide_next:
            out.append(REDACTED)
        elif secret and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        else:
            out.append(arg)
        hide_next = secret and "=" not in arg
    return out
