"""Media URLs that cannot be fetched are the client's problem: a 4xx, not a 500.

vLLM answers 500 when an image URL's host refuses the connection, does not
resolve, or does not answer in time (it treats them as transient, for
client retries). Behind a proxy that 500 reads as "this instance is
broken": the proxy retries every instance and fails over to local encoding,
only to get the same 500 everywhere. We turn those fetch failures into
vLLM's own 422 with a message naming the URL's host. Installed in the API
server process only, where media is fetched; a no-op if vLLM moved the hook.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


def install() -> bool:
    try:
        import aiohttp
        from vllm.exceptions import VLLMUnprocessableEntityError
        from vllm.multimodal.media import connector
    except ImportError:
        return False
    original = getattr(connector, "_wrap_media_fetch_error", None)
    if original is None or getattr(original, "_ascendserve", False):
        return False

    def wrap(url: str, exc: Exception):
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.InvalidURL, asyncio.TimeoutError, TimeoutError)):
            host = urlsplit(url).netloc or url[:100]
            why = "timed out" if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) else "could not connect"
            return VLLMUnprocessableEntityError(f"Failed to fetch media from URL: {why} ({host})",
                                                parameter="image_url", value=url[:200])
        return original(url, exc)

    wrap._ascendserve = True
    connector._wrap_media_fetch_error = wrap
    return True
