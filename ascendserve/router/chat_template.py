"""A model's chat template rendered in the proxy as vLLM has transformers render it.

For a plain chat (every message a role and a string content; no tools, documents, template of
the request's own or template arguments) vLLM's conversation is the messages as sent, and
transformers renders the model's template (`chat_template.jinja`, else tokenizer_config.json's
`chat_template`) in a sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`, the
loop-controls extension, its own `tojson`, `raise_exception` and `strftime_now`, the messages,
`add_generation_prompt` (vLLM's default: true) and the tokenizer's special tokens by name; vLLM
then tokenizes the text without adding special tokens (a chat's default). Anything else, or a
template this environment cannot compile (transformers' `{% generation %}` tag), is left to
the engine's /tokenize. Whatever is rendered here is checked against the prompt ids the engine
reports (router/kv_route.py): an engine started with a template of its own is caught there.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import structlog

log = structlog.get_logger("ascendserve.router.chat_template")

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PLAIN_KEYS = frozenset({"role", "content"})
REQUEST_TEMPLATE_FIELDS = ("tools", "documents", "chat_template", "chat_template_kwargs", "continue_final_message",
                           "mm_processor_kwargs")


def _content(token) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class LocalChat:
    def __init__(self, template, special: dict[str, object]):
        self.template, self.special = template, special

    @classmethod
    def load(cls, root: str) -> "LocalChat | None":
        """The model directory's template, compiled; None when it has none or it does not compile."""
        try:
            config = {}
            path = os.path.join(root, "tokenizer_config.json")
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            source = None
            jinja_file = os.path.join(root, "chat_template.jinja")
            if os.path.isfile(jinja_file):
                with open(jinja_file, encoding="utf-8") as f:
                    source = f.read()
            elif isinstance(config.get("chat_template"), str):
                source = config["chat_template"]
            elif isinstance(config.get("chat_template"), list):  # named templates: transformers' default one
                source = next((t.get("template") for t in config["chat_template"]
                               if isinstance(t, dict) and t.get("name") == "default"), None)
            if not source:
                return None
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            template = env.from_string(source)
        except Exception as exc:  # a template for another environment: the engine renders it
            log.info("chat template not renderable in the proxy; chats are tokenized by the engine", root=root,
                     error=str(exc)[:200])
            return None
        special: dict[str, object] = {k: v for k in SPECIAL if (v := _content(config.get(k))) is not None}
        extra = [t for t in map(_content, config.get("additional_special_tokens") or ()) if t is not None]
        if extra:
            special["additional_special_tokens"] = extra
        return cls(template, special)

    def render(self, body: dict) -> str | None:
        """The prompt text of a plain chat, None for anything else."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or any(k in body for k in REQUEST_TEMPLATE_FIELDS):
            return None
        for m in messages:
            if not isinstance(m, dict) or not set(m) <= PLAIN_KEYS or not isinstance(m.get("content"), str) \
                    or not isinstance(m.get("role"), str):
                return None
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                                        **self.special)
        except Exception:  # raise_exception in the template (a role it refuses...): the engine says
            return None
