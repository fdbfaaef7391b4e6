"""The client-facing OpenAI API: request checks, multimodal detection, error bodies.

Bodies stay plain dicts so that fields we do not know pass through to vLLM
untouched; only the fields the proxy acts on are checked here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ascendserve.protocol.wire import decode_json

# Content-part types that carry a multimodal item (OpenAI + vLLM extensions).
MM_PART_TYPES = frozenset({"image_url", "image", "image_pil", "image_embeds",
                           "audio_url", "input_audio", "audio", "video_url", "video"})


class APIError(Exception):
    """An error the client should see as an OpenAI-style body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code or str(self.status))


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _expect(body: dict, key: str, types: tuple, what: str, required: bool = False) -> Any:
    if key not in body or body[key] is None:
        if required:
            raise APIError(400, f"'{key}' is required", param=key)
        return None
    value = body[key]
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        raise APIError(400, f"'{key}' must be {what}, got {type(value).__name__}", param=key)
    return value


def parse(raw: bytes, kind: str) -> dict:
    """Decode and check a /v1/chat/completions (kind 'chat') or /v1/completions body."""
    try:
        body = decode_json(raw)
    except msgspec.DecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    _expect(body, "model", (str,), "a string", required=True)
    _expect(body, "stream", (bool,), "a boolean")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = _expect(body, key, (int,), "an integer")
        if value is not None and value < 1:
            raise APIError(400, f"'{key}' must be >= 1, got {value}", param=key)
    if kind == "chat":
        messages = _expect(body, "messages", (list,), "an array", required=True)
        if not messages:
            raise APIError(400, "'messages' must not be empty", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise APIError(400, f"messages[{i}].content must be a string or an array", param="messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise APIError(400, "'prompt' must be a string or a non-empty array", param="prompt")
    opts = _expect(body, "stream_options", (dict,), "an object")
    if opts is not None and "include_usage" in opts and not isinstance(opts["include_usage"], bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return body


def mm_parts(body: dict) -> list[tuple[int, int, dict]]:
    """(message index, part index, part) of every multimodal content part."""
    found = []
    for i, message in enumerate(body.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in MM_PART_TYPES:
                    found.append((i, j, part))
    return found


def prompt_chars(body: dict) -> int:
    """Characters of prompt text; the proxy's cheap stand-in for prompt tokens."""
    if "prompt" in body:
        p = body["prompt"]
        return len(p) if isinstance(p, str) else sum(len(x) if isinstance(x, str) else 1 for x in p)
    total = 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content
                         if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return total


def estimated_tokens(body: dict) -> int:
    return prompt_chars(body) // 4 + 1


def max_new_tokens(body: dict, default: int = 16) -> int:
    return body.get("max_completion_tokens") or body.get("max_tokens") or default


def only_part(body: dict, msg_index: int, part_index: int) -> dict:
    """A copy of a chat body whose messages keep a single multimodal part (fan-out)."""
    out = dict(body)
    message = dict(body["messages"][msg_index])
    message["content"] = [body["messages"][msg_index]["content"][part_index]]
    out["messages"] = [message]
    return out
