import base64
import io

import pytest

from ascendserve.router.media import DEFAULT_AREA, PATCH_AREA, encoder_tokens, image_size


def data_url(fmt: str, w: int, h: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF"])
def test_reads_size_from_header(fmt):
    assert image_size(data_url(fmt, 640, 360)) == (640, 360)


def test_unknown_sources_get_default_area():
    assert image_size("http://example.invalid/a.png") is None
    assert image_size("data:image/png;base64,!!!!") is None
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "audio_url", "audio_url": {"url": "u"}}]
    assert encoder_tokens(parts) == 2 * (DEFAULT_AREA // PATCH_AREA)


def test_bigger_images_cost_more():
    small = encoder_tokens([{"type": "image_url", "image_url": {"url": data_url("PNG", 112, 112)}}])
    big = encoder_tokens([{"type": "image_url", "image_url": {"url": data_url("PNG", 1120, 1120)}}])
    assert small == 16 and big == 1600
