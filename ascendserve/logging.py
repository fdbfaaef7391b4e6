"""structlog everywhere: one renderer for our lines, vLLM's, and uvicorn's.

Every line carries `role` and `instance_id`; lines emitted while a request is
being served carry its `request_id` (bound at the HTTP edge with
structlog.contextvars). JSON when stderr is not a terminal, console otherwise.

Secrets are kept out of the code's log calls; as a last line of defence every
rendered line has the values of this process's secrets (`configure(secrets=)`
and the SECRET_ENV variables, which also reach vLLM's processes) replaced by
"***", whoever logged them.

vLLM configures logging in each of its processes (API server, engine core,
workers) from a dictConfig file named by VLLM_LOGGING_CONFIG_PATH;
`vllm_dictconfig()` builds that file so vLLM's own records go through the
same formatter.
"""

from __future__ import annotations

import json
import logging
import logging.config
import sys
from typing import Any

import structlog

# Variables whose values are secrets wherever they are set (the engine's processes get the token this way).
SECRET_ENV = ("ASCENDSERVE_CLUSTER_TOKEN", "ASCENDSERVE_API_KEY", "VLLM_API_KEY")
MIN_SECRET_CHARS = 6  # shorter values would mask ordinary words (and are no secret anyway)
MASK = "***"


def secret_masker(secrets):
    """A last processor: the rendered line with every secret (as is, and as JSON
    escapes it) replaced by MASK. Longest first, so one secret inside another goes too."""
    needles: set[str] = set()
    for secret in secrets:
        if secret and len(secret) >= MIN_SECRET_CHARS:
            needles |= {secret, json.dumps(secret)[1:-1]}
    ordered = sorted(needles, key=len, reverse=True)

    def mask(_logger, _method, line):
        if isinstance(line, str):
            for needle in ordered:
                if needle in line:
                    line = line.replace(needle, MASK)
        return line

    return mask


def _env_secrets() -> list[str]:
    from ascendserve.config import environ

    env = environ()
    values = [env.get(name, "") for name in SECRET_ENV]
    return values + [part for v in values for part in v.replace(",", " ").split()]  # lists: --api-key k1,k2


def use_json(fmt: str) -> bool:
    if fmt == "json":
        return True
    if fmt == "console":
        return False
    return not sys.stderr.isatty()


def _static_fields(fields: dict[str, Any]):
    def add(_logger, _method, event_dict):
        for k, v in fields.items():
            event_dict.setdefault(k, v)
        return event_dict

    return add


def _foreign_fields(_logger, _method, event_dict):
    event_dict.pop("color_message", None)  # uvicorn's ANSI duplicate of `event`
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("logger", record.name)
        if record.processName != "MainProcess":
            event_dict.setdefault("process", record.processName)
        event_dict.setdefault("pid", record.process)
    return event_dict


def make_formatter(role: str = "", instance_id: str = "", fmt: str = "auto",
                   secrets: list[str] | None = None) -> logging.Formatter:
    """A stdlib Formatter rendering any record as a structlog event.

    Referenced by name from the dictConfig vLLM loads in its child processes,
    hence a module-level factory with plain-string arguments (`secrets` only
    in process: the dictConfig file never holds them, SECRET_ENV does)."""
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json(fmt)
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), _foreign_fields],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _static_fields({"role": role, "instance_id": instance_id}),
            structlog.processors.format_exc_info,
            renderer,
            secret_masker([*(secrets or []), *_env_secrets()]),
        ],
    )


def vllm_dictconfig(role: str, instance_id: str, level: str, fmt: str) -> dict:
    """dictConfig for every vLLM process: our formatter on the root logger."""
    lvl = level.upper()
    handler = {"class": "logging.StreamHandler", "formatter": "ascendserve", "stream": "ext://sys.stderr"}
    own = {"handlers": ["ascendserve"], "level": lvl, "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "ascendserve": {
                "()": "ascendserve.logging.make_formatter",
                "role": role,
                "instance_id": instance_id,
                "fmt": fmt,
            }
        },
        "handlers": {"ascendserve": handler},
        "loggers": {name: dict(own) for name in ("vllm", "uvicorn", "uvicorn.error", "uvicorn.access", "ascendserve")},
        "root": {"handlers": ["ascendserve"], "level": lvl},
    }


def configure(role: str, instance_id: str, level: str = "info", fmt: str = "auto",
              secrets: list[str] | None = None) -> None:
    """Configure structlog and stdlib logging for this process; `secrets` are masked in every line."""
    config = vllm_dictconfig(role, instance_id, level, fmt)
    config["formatters"]["ascendserve"]["secrets"] = list(secrets or [])
    logging.config.dictConfig(config)
    route_structlog_to_stdlib()


def route_structlog_to_stdlib() -> None:
    """structlog events go through stdlib logging (and so through the formatter
    vLLM's dictConfig installed). Called in every vLLM process by the plugin."""
    logging.captureWarnings(True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "ascendserve") -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def log_library(logger: str, loaded: bool, library: str, used: str, instead: str, reason: str) -> None:
    """The one line saying what a native library's loading left a process with: `used` (naming the
    library) when it loaded, else `instead` with the reason."""
    log = get_logger(logger)
    if loaded:
        log.info(used, library=library)
    else:
        log.info(instead, reason=reason)
