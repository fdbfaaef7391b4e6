"""Cheap image-size reading for encoder load balancing (no image library).

Reads width x height from the header of a PNG, JPEG, GIF or WebP carried in
a data: URL, decoding only the first few kilobytes of base64. Anything else
(http URLs, audio, video, unknown formats) gets a default area.
"""

from __future__ import annotations

import base64
import binascii
import struct

DEFAULT_AREA = 448 * 448
PATCH_AREA = 28 * 28  # one merged vision token in the Qwen2-VL family
_HEAD_B64 = 64 * 1024  # base64 chars decoded at most (48 KiB of image)


def _head(url: str) -> bytes | None:
    if not url.startswith("data:"):
        return None
    comma = url.find(",")
    if comma < 0 or ";base64" not in url[:comma]:
        return None
    chunk = url[comma + 1: comma + 1 + _HEAD_B64]
    chunk = chunk[: len(chunk) - len(chunk) % 4]
    try:
        return base64.b64decode(chunk, validate=False)
    except (binascii.Error, ValueError):
        return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            i += 1
            continue
        marker = data[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2: i + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", data[i + 5: i + 9])
            return w, h
        i += 2 + length
    return None


def image_size(url: str) -> tuple[int, int] | None:
    data = _head(url)
    if not data:
        return None
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP" and data[12:16] == b"VP8X" and len(data) >= 30:
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return w, h
    return None


def part_url(part: dict) -> str:
    for key in ("image_url", "video_url", "audio_url"):
        value = part.get(key)
        if isinstance(value, dict):
            return str(value.get("url", ""))
        if isinstance(value, str):
            return value
    return ""


def encoder_tokens(parts: list[dict]) -> int:
    """Encoder load of these parts, in vision tokens (area / 28x28)."""
    total = 0
    for part in parts:
        size = image_size(part_url(part)) if part.get("type") == "image_url" else None
        area = size[0] * size[1] if size else DEFAULT_AREA
        total += max(1, area // PATCH_AREA)
    return total
