"""Structure-aware mutation for the msgpack-framed and JSON targets.

libFuzzer flips bytes, which rarely turns a msgpack string into a map or a
JSON number into a 1,000-deep array while keeping the rest parseable. Half
of the time this mutator parses the input instead (a stream of frames, or
one JSON document behind the target's selector bytes), replaces one value
anywhere in it with a value of another type or an edge case, drops a key or
adds one, and encodes it again; the other half it lets libFuzzer mutate the
bytes. Either way coverage decides what stays in the corpus.
"""

from __future__ import annotations

import random

import atheris
import msgspec

from ascendserve.protocol import frames

DEEP = 1200  # past the interpreter's recursion limit, under MAX_HEADER bytes
# msgspec refuses to encode what it refuses to decode, so a deep value is this marker
# until encoded, then its bytes are swapped for nested arrays / maps
DEEP_MARK = "\x00deep\x00"
_DEEP_BYTES = {
    "msgpack": (msgspec.msgpack.encode(DEEP_MARK), [b"\x91" * DEEP + b"\xc0", b"\x81\xa1k" * DEEP + b"\xc0"]),
    "json": (msgspec.json.encode(DEEP_MARK), [b"[" * DEEP + b"]" * DEEP, b'{"k":' * DEEP + b"0" + b"}" * DEEP]),
}


def encode(value, fmt: str, rng: random.Random) -> bytes:
    raw = msgspec.json.encode(value) if fmt == "json" else msgspec.msgpack.encode(value)
    mark, deep = _DEEP_BYTES[fmt]
    return raw.replace(mark, rng.choice(deep))


def _edge(rng: random.Random, strings: list[str], binary: bool):
    pick = rng.randrange(17)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, 1, -1, 2, 255, 256, 2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, -2**63])
    if pick == 3:
        return rng.choice([0.0, -0.0, 1.5, 1e308, -1e-308])
    if pick == 4:
        return ""
    if pick in (5, 6, 7):
        return rng.choice(strings) if strings else "x"
    if pick == 8:
        return rng.choice(["x" * 300, "\u00e9\u4e2d\U0001f600", "a/b", "../..", "asf-kv-1-1", "\x00"])
    if pick == 9:
        return []
    if pick == 10:
        return {}
    if pick == 11:
        return [rng.randrange(-2, 10) for _ in range(rng.randrange(1, 40))]
    if pick == 12:
        return {rng.choice(strings) if strings else "k": None}
    if pick == 13:
        return DEEP_MARK
    if pick == 14:
        return rng.choice([2**64 - 1, 2**64 - 2]) if binary else 2**70
    if pick == 15 and binary:
        return rng.choice([b"", b"\xff" * 9, msgspec.msgpack.Ext(1, b"x")])
    return [None, 1, "x", [], {}]


MAX_DEPTH = 6  # values below this are replaced whole: a deep input must not crowd out the rest


def _containers(value, out: list, depth: int = 0) -> list:
    if isinstance(value, (dict, list)) and depth < MAX_DEPTH:
        out.append(value)
        for child in (value.values() if isinstance(value, dict) else value):
            if len(out) < 200:
                _containers(child, out, depth + 1)
    return out


def _strings(value, out: list, depth: int = 0) -> list:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict) and depth < MAX_DEPTH:
        for k, v in value.items():
            _strings(k, out, depth + 1)
            _strings(v, out, depth + 1)
    elif isinstance(value, list) and depth < MAX_DEPTH:
        for v in value[:50]:
            _strings(v, out, depth + 1)
    return out


def mutate_value(root, rng: random.Random, binary: bool):
    """`root` with one value somewhere replaced, dropped or added (in place where it can)."""
    strings = _strings(root, [])
    nodes = _containers(root, [])
    if not nodes or rng.random() < 0.05:
        return _edge(rng, strings, binary)
    node = rng.choice(nodes)
    if isinstance(node, dict):
        keys = list(node)
        if keys and rng.random() < 0.15:
            del node[rng.choice(keys)]
        elif keys and rng.random() < 0.85:
            node[rng.choice(keys)] = _edge(rng, strings, binary)
        else:
            node[rng.choice(strings) if strings and rng.random() < 0.7 else "extra"] = _edge(rng, strings, binary)
    elif node and rng.random() < 0.8:
        node[rng.randrange(len(node))] = _edge(rng, strings, binary)
    else:
        node.append(_edge(rng, strings, binary))
    return root


def split_frames(data: bytes) -> tuple[list[tuple[dict, bytes]], bytes]:
    """The frames at the start of `data` and the bytes after the last whole one."""
    out, i = [], 0
    while len(data) - i >= frames.PREFIX.size:
        prefix = data[i:i + frames.PREFIX.size]
        try:
            n = frames.header_length(prefix)
            header = frames.decode_header(prefix, data[i + 8:i + 8 + n])
        except (frames.FrameError, RecursionError):
            break
        payload = header.get("payload", 0)
        end = i + 8 + n + payload
        if end > len(data):
            break
        out.append((header, data[i + 8 + n:end]))
        i = end
    return out, data[i:]


def join_frames(parts: list[tuple[dict, bytes]], rest: bytes, rng: random.Random) -> bytes:
    out = []
    for header, payload in parts:
        body = encode(header, "msgpack", rng)
        out.append(frames.PREFIX.pack(frames.MAGIC, len(body)) + body + payload)
    return b"".join(out) + rest


def structured(fmt: str, skip: int):
    """A custom mutator for atheris: `fmt` is "frames" or "json"; the first `skip` bytes select a mode."""

    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        head, body = data[:skip], data[skip:]
        if rng.random() < 0.1 and head:
            head = bytes([rng.randrange(256)]) + head[1:]
        if rng.random() < 0.5:
            return atheris.Mutate(data, max_size)
        try:
            if fmt == "json":
                out = encode(mutate_value(msgspec.json.decode(body), rng, binary=False), "json", rng)
            else:
                parts, rest = split_frames(body)
                if not parts:
                    return atheris.Mutate(data, max_size)
                k = rng.randrange(len(parts))
                if rng.random() < 0.1:
                    parts.insert(k, parts[k])  # a frame again (a replay)
                elif rng.random() < 0.1 and len(parts) > 1:
                    del parts[k]
                else:
                    header, payload = parts[k]
                    new = mutate_value(header, rng, binary=True)
                    parts[k] = (new if isinstance(new, dict) else {"type": new}, payload)
                out = join_frames(parts, rest, rng)
        except (msgspec.DecodeError, msgspec.EncodeError, RecursionError, TypeError, OverflowError):
            return atheris.Mutate(data, max_size)
        out = head + out
        return out if len(out) <= max_size else atheris.Mutate(data, max_size)

    return mutator
