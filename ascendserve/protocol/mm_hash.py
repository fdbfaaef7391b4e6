"""vLLM's `mm_hash` of an image content part, computed without vLLM or torch.

vLLM keys its encoder cache (and every EC connector) by a digest of
`model_id` (the model path the engine was started with) and the item's
original encoded bytes, fed through a framed, tagged byte stream
(vllm/multimodal/hasher.py). An image whose mode is not RGB is converted on
load, so the digest also covers the conversion settings. This module
rebuilds that stream for the cases the proxy can see from the request
(data: URLs, client-supplied `uuid`s); a unit test pins equality with
vLLM's own hasher on the same inputs. Anything else (remote URLs, request
`mm_processor_kwargs`) returns None: the proxy then simply asks the encoder.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Iterator

_TAG_NONE, _TAG_SEQUENCE, _TAG_MAPPING, _TAG_LEAF = b"\x00", b"\x01", b"\x02", b"\x03"
ALGORITHMS = ("blake3", "sha256", "sha512")
RGBA_BACKGROUND = (255, 255, 255)  # vLLM's ImageMediaIO default


def _len(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield _len(len(chunk))
    yield chunk


def _leaf(obj: object) -> Iterator[bytes]:
    if isinstance(obj, bytes):
        yield from _framed(obj)
    elif isinstance(obj, str):
        yield from _framed(obj.encode())
    elif isinstance(obj, bool) or not isinstance(obj, int):
        raise TypeError(f"cannot hash {type(obj).__name__} like vLLM does")
    else:
        yield from _framed(obj.to_bytes(8, "little", signed=True))  # np.array(int).tobytes(): int64


def _value(obj: object) -> Iterator[bytes]:
    if obj is None:
        yield _TAG_NONE
    elif isinstance(obj, (list, tuple)):
        yield _TAG_SEQUENCE
        yield _len(len(obj))
        for x in obj:
            yield from _value(x)
    elif isinstance(obj, dict):
        yield _TAG_MAPPING
        yield _len(len(obj))
        for k, v in obj.items():
            yield from _framed(str(k).encode())
            yield from _value(v)
    else:
        yield _TAG_LEAF
        yield from _leaf(obj)


def _item(key: str, obj: object) -> Iterator[bytes]:
    yield from _framed(key.encode())
    yield from _value(obj)


def _hasher(algorithm: str):
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3()
    if algorithm in ("sha256", "sha512"):
        return hashlib.new(algorithm)
    raise ValueError(f"mm hash algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")


def image_hash(model_id: str, data: bytes, mode: str, algorithm: str = "blake3") -> str:
    """mm_hash of an image given its encoded bytes and PIL mode (as vLLM loads it from bytes)."""
    h = _hasher(algorithm)
    # the image leaf: vLLM's MediaWithBytes serialises as ("image", bytes) or, when
    # loading converted the mode, ("image", {"io_config": ..., "data": bytes})
    if mode == "RGB":
        media: object = data
    else:
        media = {"io_config": {"image_mode": "RGB", "rgba_background_color": RGBA_BACKGROUND}, "data": data}
    for key, value in sorted({"image": None, "model_id": model_id}.items()):
        h.update(b"".join(_framed(key.encode())))
        if key == "image":
            h.update(_TAG_LEAF + b"".join(_item("image", media)))
        else:
            h.update(b"".join(_value(value)))
    return h.hexdigest()


def data_url_bytes(url: str) -> bytes | None:
    """The decoded payload of a base64 data: URL, None for anything else."""
    if not url.startswith("data:"):
        return None
    meta, sep, payload = url[5:].partition(",")
    if not sep or not meta.endswith(";base64"):
        return None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def image_mode(data: bytes) -> str | None:
    """PIL's mode of an encoded image (header only); None if it is not an image."""
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            return im.mode
    except Exception:
        return None


def part_hash(part: dict, model_id: str, algorithm: str = "blake3") -> str | None:
    """vLLM's mm_hash of one chat content part, or None when the proxy cannot know it."""
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return uuid
    if part.get("type") != "image_url":
        return None
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        return None
    data = data_url_bytes(url)
    if data is None:
        return None
    mode = image_mode(data)
    if mode is None:
        return None
    return image_hash(model_id, data, mode, algorithm)
