"""Image parts of a chat request -> encoded image bytes, under the server's media policy.

* ``data:`` URLs: passed through unchanged; the engine's input processor decodes them (one
  decoder; the request body limit already bounds their size);
* ``http(s)://`` URLs: fetched with a timeout and a byte cap (read as a stream; the download
  stops at the cap, whatever Content-Length claims);
* local paths and ``file://`` URLs: only under ``--allowed-local-media-path`` (vLLM's flag),
  checked on the resolved path so ``..`` and symlinks cannot leave the directory.

Decoding and the image checks (corrupt, truncated, 1x1, aspect ratio, pixel cap) are the
engine's, through the processor: this module only moves bytes and never decodes an image.
Every failure is an `APIError(400)` that names the image part."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from ...inputs import sources
from ...inputs.sources import parse_source
from .errors import bad_request


@dataclass(frozen=True)
class MediaPolicy:
    max_bytes: int                        # per image, after decoding base64
    fetch_timeout: float                  # seconds, whole http(s) fetch
    allowed_local_path: Path | None       # resolved directory, or None: local files refused


class MediaFetcher:
    def __init__(self, policy: MediaPolicy):
        self.policy = policy
        self._client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # trust_env=False: no proxy variables; follow a few redirects like a browser
            self._client = httpx.AsyncClient(timeout=self.policy.fetch_timeout, follow_redirects=True,
                                             max_redirects=5, trust_env=False)
        return self._client

    async def fetch(self, url: str, label: str) -> bytes | str:
        if not isinstance(url, str) or not url.strip():
            raise bad_request(f"{label}: the image URL is empty", param="messages")
        url = url.strip()
        src = parse_source(url)        # the engine's resolve_source reads strings the same way
        if src.scheme == sources.DATA:
            return url
        if src.scheme in (sources.HTTP, sources.HTTPS):
            return await self._fetch_http(url, label)
        if src.scheme in (sources.FILE, sources.PATH):
            return self._local(src.path, label)
        raise bad_request(f"{label}: unsupported URL scheme {src.scheme!r} (use data:, http(s):// or a local path)",
                          param="messages")

    def _check_size(self, n: int, label: str) -> None:
        if n > self.policy.max_bytes:
            raise bad_request(f"{label}: image is larger than the {self.policy.max_bytes} byte limit",
                              param="messages", code="image_too_large")

    async def _fetch_http(self, url: str, label: str) -> bytes:
        try:
            async with self._http().stream("GET", url) as r:
                if r.status_code != 200:
                    raise bad_request(f"{label}: fetching {url} returned HTTP {r.status_code}", param="messages",
                                      code="image_fetch_failed")
                declared = r.headers.get("content-length")
                if declared and declared.isdigit():
                    self._check_size(int(declared), label)
                buf = bytearray()
                async for chunk in r.aiter_bytes():
                    buf += chunk
                    self._check_size(len(buf), label)
                return bytes(buf)
        except httpx.TimeoutException:
            raise bad_request(f"{label}: fetching {url} timed out after {self.policy.fetch_timeout:g} s",
                              param="messages", code="image_fetch_timeout") from None
        except httpx.HTTPError as e:
            raise bad_request(f"{label}: fetching {url} failed ({type(e).__name__}: {e})", param="messages",
                              code="image_fetch_failed") from None

    def _local(self, path: str, label: str) -> bytes:
        root = self.policy.allowed_local_path
        if root is None:
            raise bad_request(f"{label}: local file paths are not allowed (the server was started without "
                              f"--allowed-local-media-path)", param="messages", code="local_path_not_allowed")
        try:
            real = Path(os.path.realpath(path))
        except (OSError, ValueError):
            raise bad_request(f"{label}: invalid local path", param="messages") from None
        if real != root and root not in real.parents:
            raise bad_request(f"{label}: {path} is outside --allowed-local-media-path", param="messages",
                              code="local_path_not_allowed")
        try:
            size = real.stat().st_size
            self._check_size(size, label)
            return real.read_bytes()
        except FileNotFoundError:
            raise bad_request(f"{label}: file not found: {path}", param="messages") from None
        except IsADirectoryError:
            raise bad_request(f"{label}: {path} is a directory", param="messages") from None
        except OSError as e:
            raise bad_request(f"{label}: cannot read {path} ({e.strerror or e})", param="messages") from None
