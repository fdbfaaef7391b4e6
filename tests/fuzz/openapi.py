"""The proxy's and the metaserver's OpenAPI documents, completed with their request bodies.

Litestar builds each app's OpenAPI document from its handlers. The roles do
not serve it (`openapi_config=None`: no unauthenticated /schema pages), so
`app_schema` builds the same document from the app `create_app` returns,
exactly as Litestar would publish it at /schema/openapi.json.

The handlers read their bodies raw (to give every bad body our own
OpenAI-style 400), so Litestar cannot describe them; `with_bodies` adds them:
the registry and push bodies straight from their wire types (msgspec's JSON
Schema of protocol/registry.py, protocol/kv_params.py), the admin body from
the proxy's own struct, and the OpenAI bodies as far as the proxy checks them
(protocol/openai.parse) with values a stub engine serves (bounded max_tokens,
its model name, images that are real PNG/JPEG headers).
"""

from __future__ import annotations

import base64
import copy
import struct

import msgspec


def app_schema(app, title: str) -> dict:
    """The OpenAPI document Litestar would serve for `app`."""
    from litestar._openapi.plugin import OpenAPIPlugin
    from litestar.openapi import OpenAPIConfig

    plugin = app.plugins.get(OpenAPIPlugin)
    if app.openapi_config is None:  # built, not served: the routes were registered with the plugin anyway
        plugin._openapi_config = OpenAPIConfig(title=title, version="test")
    return copy.deepcopy(plugin.provide_openapi_schema())


def with_bodies(schema: dict, bodies: dict[tuple[str, str], dict], components: dict | None = None) -> dict:
    """`schema` with a required JSON request body on each (method, path) of `bodies`."""
    out = copy.deepcopy(schema)
    out.setdefault("components", {}).setdefault("schemas", {}).update(components or {})
    for (method, path), body in bodies.items():
        operation = out["paths"][path][method]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return out


def wire_bodies(types: dict[tuple[str, str], type]) -> tuple[dict, dict]:
    """(bodies, components) of msgspec types, with their refs under #/components/schemas."""
    keys = list(types)
    refs, components = msgspec.json.schema_components([types[k] for k in keys],
                                                      ref_template="#/components/schemas/{name}")
    return dict(zip(keys, refs)), components


def _data_url(kind: str) -> str:
    if kind == "png":
        raw = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + struct.pack(">II", 32, 16) + b"\x08\x02\x00\x00\x00"
        return "data:image/png;base64," + base64.b64encode(raw).decode()
    raw = b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x10\x00\x20\x03\x01\x22\x00"
    return "data:image/jpeg;base64," + base64.b64encode(raw).decode()


def openai_bodies(model: str, max_tokens: int = 8) -> dict[tuple[str, str], dict]:
    """What the proxy checks of /v1/chat/completions and /v1/completions; other fields pass through."""
    tokens = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    common = {"model": {"const": model}, "stream": {"type": "boolean"}, "max_tokens": tokens,
              "max_completion_tokens": tokens, "n": {"type": "integer", "minimum": 1, "maximum": 2},
              "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}}
    image = {"anyOf": [{"type": "string"}, {"enum": [_data_url("png"), _data_url("jpeg")]},
                       {"type": "object", "properties": {"url": {"enum": [_data_url("png"), _data_url("jpeg")]}},
                        "required": ["url"]}]}
    part = {"type": "object", "properties": {"type": {"enum": ["text", "image_url", "input_audio", "video_url"]},
                                             "text": {"type": "string"}, "image_url": image,
                                             "uuid": {"type": "string"}}, "required": ["type"]}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "maxItems": 3, "items": part}]}}}
    chat = {"type": "object", "required": ["model", "messages"],
            "properties": {**common, "messages": {"type": "array", "minItems": 1, "maxItems": 3, "items": message}},
            "examples": [{"model": model, "max_tokens": 2, "stream": True,
                          "messages": [{"role": "user", "content": [
                              {"type": "text", "text": "what is it"},
                              {"type": "image_url", "image_url": {"url": _data_url("png")}}]}]}]}
    prompt = {"anyOf": [{"type": "string"},
                        {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string"}},
                        {"type": "array", "minItems": 1, "maxItems": 8,
                         "items": {"type": "integer", "minimum": 0, "maximum": 1000}}]}
    completions = {"type": "object", "required": ["model", "prompt"], "properties": {**common, "prompt": prompt}}
    return {("post", "/v1/chat/completions"): chat, ("post", "/v1/completions"): completions}


def admin_body(types: tuple[str, ...], dead_host: str) -> dict:
    """vllm-ascend's /instances/add|remove body; addresses on a host where nothing listens, so
    fuzzing adds instances that never turn healthy and removes none of the real ones."""
    address = {"type": "string", "pattern": rf"^{dead_host.replace('.', chr(92) + '.')}:[1-9][0-9]{{0,3}}$"}
    return {"type": "object", "required": ["type", "instances"], "properties": {
        "type": {"enum": list(types)},
        "instances": {"anyOf": [address, {"type": "array", "maxItems": 3, "items": address}]}}}
