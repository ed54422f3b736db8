"""Loading images from what users send: PIL images, data URLs, http(s) URLs and (when allowed) local files.

Every failure is a ``ValueError`` whose message starts with the field it came from (the caller passes it, e.g.
``messages[0].content[1].image_url``), which the server turns into an HTTP 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # per image, downloaded or decoded


@dataclass(frozen=True)
class MediaConnector:
    """How far the server may reach for an image: http(s) with a timeout and a size cap; ``file://`` only under
    ``allowed_local_media_path`` (None: never)."""

    allowed_local_media_path: str | None = None
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def load_image(self, source: Any, field: str) -> Any:
        """A PIL image (RGB) from a PIL image, a ``data:image/...;base64,`` URL, an http(s) URL or a ``file://``
        URL."""
        from PIL import Image

        if isinstance(source, Image.Image):
            return _to_rgb(source, field)
        if not isinstance(source, str) or not source:
            raise ValueError(f"{field} must be a URL string or a PIL image, got {type(source).__name__}")
        if source.startswith("data:"):
            return decode_image_bytes(self._data_url_bytes(source, field), field)
        scheme = urllib.parse.urlsplit(source).scheme.lower()
        if scheme in ("http", "https"):
            return decode_image_bytes(self._fetch(source, field), field)
        if scheme == "file":
            return decode_image_bytes(self._read_local(source, field), field)
        raise ValueError(f"{field}: unsupported URL scheme {scheme or source[:20]!r}; use data:, http(s):// or file://")

    def _data_url_bytes(self, url: str, field: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ValueError(f"{field}: a data URL must look like 'data:image/<type>;base64,<data>'")
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            raise ValueError(f"{field}: the image is larger than the {self.max_bytes}-byte limit")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{field}: the data URL is not valid base64: {e}") from e

    def _fetch(self, url: str, field: str) -> bytes:
        req = urllib.request.Request(url, headers={"User-Agent": "pagedllm"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - scheme checked above
                length = resp.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise ValueError(f"{field}: the image is larger than the {self.max_bytes}-byte limit")
                data = resp.read(self.max_bytes + 1)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - URLError, HTTPError, timeouts: all "could not fetch"
            raise ValueError(f"{field}: could not fetch {url[:200]!r}: {e}") from e
        if len(data) > self.max_bytes:
            raise ValueError(f"{field}: the image is larger than the {self.max_bytes}-byte limit")
        return data

    def _read_local(self, url: str, field: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError(f"{field}: file:// URLs are refused unless the server runs with --allowed-local-media-path")
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        root = os.path.realpath(self.allowed_local_media_path)
        if os.path.commonpath([path, root]) != root:
            raise ValueError(f"{field}: {path!r} is outside the allowed local media path")
        try:
            if os.path.getsize(path) > self.max_bytes:
                raise ValueError(f"{field}: the image is larger than the {self.max_bytes}-byte limit")
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{field}: cannot read {path!r}: {e.strerror}") from e


def decode_image_bytes(data: bytes, field: str) -> Any:
    """Decode PNG / JPEG / WebP / ... bytes into an RGB PIL image; ``ValueError`` naming ``field`` if they are not an
    image PIL can read."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{field}: cannot decode the image: not a format PIL reads (PNG, JPEG, WebP, ...)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{field}: cannot decode the image: {e}") from e
    return _to_rgb(image, field)


def _to_rgb(image: Any, field: str) -> Any:
    if image.width < 1 or image.height < 1:
        raise ValueError(f"{field}: the image is empty ({image.width}x{image.height})")
    return image if image.mode == "RGB" else image.convert("RGB")
