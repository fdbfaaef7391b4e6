"""The proxy's mm_hash equals vLLM's hasher on the same inputs (and imports neither torch nor vLLM)."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ascendserve.protocol.mm_hash import data_url_bytes, part_hash

MODEL = "/models/tiny-vl"


def encoded(mode: str, fmt: str, seed: int = 0, size=(37, 23)) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}.get(mode, 3)
    arr = (rng.random((size[1], size[0], channels)) * 255).astype("uint8")
    im = Image.fromarray(arr.squeeze(-1) if channels == 1 else arr, mode if mode != "P" else "RGB")
    if mode == "P":
        im = im.convert("P")
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def vllm_hash(data: bytes, algorithm: str) -> str:
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    media = ImageMediaIO().load_base64("image/png", base64.b64encode(data).decode())
    return MultiModalHasher.hash_kwargs(algorithm, model_id=MODEL, image=media)


@pytest.mark.parametrize("mode,fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG"),
                                      ("LA", "PNG"), ("RGB", "JPEG"), ("L", "JPEG")])
@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_equals_vllm_hasher(mode, fmt, algorithm):
    data = encoded(mode, fmt, seed=len(mode) + len(fmt))
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    ours = part_hash({"type": "image_url", "image_url": {"url": url}}, MODEL, algorithm)
    assert ours == vllm_hash(data, algorithm)


def test_unknowable_parts_give_none():
    assert part_hash({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, MODEL) is None
    assert part_hash({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, MODEL) is None
    assert part_hash({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, MODEL) is None
    assert part_hash({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, MODEL) is None
    assert part_hash({"type": "image_url", "image_url": {"url": "x"}, "uuid": "my-id"}, MODEL) == "my-id"
    assert data_url_bytes("data:text/plain,hello") is None


def test_model_id_and_bytes_change_the_hash():
    url = "data:image/png;base64," + base64.b64encode(encoded("RGB", "PNG")).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    assert part_hash(part, MODEL) != part_hash(part, MODEL + "x")
    other = "data:image/png;base64," + base64.b64encode(encoded("RGB", "PNG", seed=9)).decode()
    assert part_hash(part, MODEL) != part_hash({"type": "image_url", "image_url": {"url": other}}, MODEL)


def test_no_torch_or_vllm_import():
    code = ("import sys, ascendserve.protocol.mm_hash as m; "
            "m.image_hash('x', b'abc', 'RGB'); "
            "assert not [k for k in sys.modules if k.split('.')[0] in ('torch', 'vllm', 'numpy')], sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
