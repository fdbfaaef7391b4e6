"""Decoding bytes a peer sent: msgspec, with the one failure it leaves untyped made typed.

msgspec decodes nested arrays and maps recursively and raises RecursionError
(not DecodeError) past the interpreter's recursion limit, which a few KiB of
`[` reach. Decoders of bytes from a socket go through these two functions,
so that input is a msgspec.DecodeError like any other malformed input and
the caller's existing handling (a 400, a FrameError, "backend answered
nonsense") applies.
"""

from __future__ import annotations

from typing import Any

import msgspec


def decode_json(raw: bytes | str, type: Any = Any) -> Any:
    try:
        return msgspec.json.decode(raw, type=type)
    except RecursionError:
        raise msgspec.DecodeError("JSON is nested too deeply") from None


def decode_msgpack(raw: bytes, type: Any = Any) -> Any:
    try:
        return msgspec.msgpack.decode(raw, type=type)
    except RecursionError:
        raise msgspec.DecodeError("MessagePack data is nested too deeply") from None
