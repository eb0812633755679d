"""Image parts of a chat request -> encoded image bytes, under the server's media policy.

* ``data:`` URLs: passed through unchanged; the engine's input processor decodes them (one
  decoder; the request body limit already bounds their size);
* ``http(s)://`` URLs (``--media-fetch on``, the default): fetched under the fetch policy below,
  with a timeout for the whole fetch (redirects included) and a byte cap (read as a stream; the
  download stops at the cap, whatever Content-Length claims); the bytes count against
  ``--max-inflight-body-bytes`` while the request runs;
* local paths and ``file://`` URLs: only under ``--allowed-local-media-path`` (vLLM's flag),
  checked on the resolved path so ``..`` and symlinks cannot leave the directory; only regular
  files (a FIFO or a device would block the reader forever), read in a worker thread.

Fetch policy (server-side request forgery): an image URL must not reach inside the server's
network. Every hop (the URL and each redirect, followed here one at a time) is checked on the
addresses its host RESOLVES to: loopback, link-local, private (RFC 1918, ULA, CGNAT) addresses
are refused unless ``--allow-private-media-fetch``; multicast, unspecified (0.0.0.0, ::) and
reserved addresses always. IPv4 literals in any form inet_aton reads (``2130706433``,
``0x7f.1``, ``0177.0.0.1``) and IPv4-mapped IPv6 are checked as the address they mean. The
connection then goes to the checked address itself (the Host header and TLS SNI carry the
name), so a DNS answer that changes between the check and the connect cannot redirect it.
``--allowed-media-domains`` restricts the host names (exact match, every hop).

Every failure of an http(s) fetch (refused by the policy, connection refused, timeout, an HTTP
status, too large, not an image) answers the client with the same message, so that the answer
says nothing about which hosts and ports exist inside; the reason is logged at WARNING.

Decoding and the image checks (corrupt, truncated, 1x1, aspect ratio, pixel cap) are the
engine's, through the processor: this module only moves bytes; it looks at a fetched body's
header only to refuse what is not an image at all (a port oracle otherwise)."""
from __future__ import annotations

import asyncio
import io
import ipaddress
import logging
import os
import re
import socket
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urljoin, urlsplit

import httpx

from ...inputs import sources
from ...inputs.sources import parse_source
from . import inflight
from .errors import APIError, bad_request

log = logging.getLogger("fastdeploy_ext.server")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: host, port -> the addresses it resolves to (a stub in tests; the event loop's getaddrinfo here)
Resolver = Callable[[str, int], Awaitable[list[str]]]

REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# IPv4 "this network" (0.0.0.0/8): connecting to it reaches the local host on Linux
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
# what inet_aton may read as an IPv4 address: digits, hex digits, x, dots
_IPV4_LIKE = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$", re.I)


@dataclass(frozen=True)
class MediaPolicy:
    max_bytes: int                        # per image, after decoding base64
    fetch_timeout: float                  # seconds, whole http(s) fetch (every hop)
    allowed_local_path: Path | None       # resolved directory, or None: local files refused
    fetch_enabled: bool = True            # --media-fetch on|off
    allowed_domains: tuple[str, ...] | None = None    # lower-case host names; None: any host
    allow_private: bool = False           # --allow-private-media-fetch
    max_redirects: int = 5


class FetchRefused(Exception):
    """Why one http(s) fetch failed; logged, never shown to the client."""


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address a URL host names literally (brackets stripped, any inet_aton IPv4 form), or
    None for a name to resolve."""
    h = host.strip("[]")
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        pass
    if _IPV4_LIKE.match(h):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            return None
    return None


def address_refusal(ip: IPAddress, allow_private: bool) -> str | None:
    """Why the policy refuses to connect to ip, or None."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_multicast:
        return "multicast address"
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        return "unspecified address"
    if ip.is_reserved or ip == ipaddress.IPv4Address("255.255.255.255"):
        return "reserved address"
    if allow_private:
        return None
    if ip.is_loopback:
        return "loopback address"
    if ip.is_link_local:
        return "link-local address"
    if ip.is_private or not ip.is_global:
        return "private address"
    return None


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def looks_like_image(data: bytes) -> bool:
    """PIL recognises the header (nothing is decoded; a huge declared size still counts as an
    image: the engine's decode cap refuses it with its own message)."""
    from PIL import Image
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)):
                return True
    except Image.DecompressionBombError:
        return True
    except Exception:  # noqa: BLE001 - anything PIL cannot identify is not an image
        return False


class MediaFetcher:
    def __init__(self, policy: MediaPolicy, resolver: Resolver | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.policy = policy
        self.resolver = resolver or system_resolver
        self._transport = transport          # tests: a recording transport; None: the network
        self._client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # trust_env=False: no proxy variables; redirects are followed here, one checked hop at a time
            self._client = httpx.AsyncClient(timeout=self.policy.fetch_timeout, follow_redirects=False,
                                             trust_env=False, transport=self._transport)
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
            return await self._local(src.path, label)
        raise bad_request(f"{label}: unsupported URL scheme {src.scheme!r} (use data:, http(s):// or a local path)",
                          param="messages")

    def _check_size(self, n: int, label: str) -> None:
        if n > self.policy.max_bytes:
            raise bad_request(f"{label}: image is larger than the {self.policy.max_bytes} byte limit",
                              param="messages", code="image_too_large")

    # ------------------------------------------------------------------ http(s)
    async def _fetch_http(self, url: str, label: str) -> bytes:
        if not self.policy.fetch_enabled:
            raise bad_request(f"{label}: this server does not fetch image URLs (--media-fetch off); send the "
                              f"image as a data: URL", param="messages", code="media_fetch_off")
        try:
            return await asyncio.wait_for(self._follow(url), timeout=self.policy.fetch_timeout)
        except (FetchRefused, httpx.HTTPError, httpx.InvalidURL, asyncio.TimeoutError, OSError, ValueError) as e:
            if isinstance(e, FetchRefused):
                why = str(e)
            elif isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException)):
                why = f"timed out after {self.policy.fetch_timeout:g} s"
            else:
                why = f"{type(e).__name__}: {e}"
            log.warning("%s: fetching %s failed: %s", label, url[:200], why)
            raise bad_request(f"{label}: the image URL could not be fetched", param="messages",
                              code="image_fetch_failed") from None

    def _check_host(self, url: str) -> tuple[str, str, int, str]:
        """url -> (scheme, host, port, path?query), refused unless http(s) to an allowed name."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise FetchRefused(f"redirect to a {scheme!r} URL")
        host = (parts.hostname or "").rstrip(".").lower()
        if not host:
            raise FetchRefused("no host in the URL")
        allowed = self.policy.allowed_domains
        if allowed is not None and host not in allowed:
            raise FetchRefused(f"host {host!r} is not in --allowed-media-domains")
        port = parts.port or (443 if scheme == "https" else 80)     # ValueError for a bad port
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return scheme, host, port, target

    async def _checked_addresses(self, host: str, port: int) -> list[IPAddress]:
        """The addresses to connect to, in order: every address the host resolves to must pass
        the policy (one refused address refuses the host, so a name cannot mix an inside
        address in)."""
        literal = parse_ip_literal(host)
        if literal is not None:
            addrs = [literal]
        else:
            try:
                addrs = [ipaddress.ip_address(a.split("%")[0]) for a in await self.resolver(host, port)]
            except (OSError, ValueError) as e:
                raise FetchRefused(f"cannot resolve {host!r} ({e})") from None
            if not addrs:
                raise FetchRefused(f"{host!r} resolves to no address")
        for a in addrs:
            why = address_refusal(a, self.policy.allow_private)
            if why is not None:
                raise FetchRefused(f"{host!r} resolves to {a}, a {why} (refused; --allow-private-media-fetch "
                                   f"allows loopback, private and link-local addresses)")
        return addrs

    async def _follow(self, url: str) -> bytes:
        for hop in range(self.policy.max_redirects + 1):
            try:
                scheme, host, port, target = self._check_host(url)
                addrs = await self._checked_addresses(host, port)
            except FetchRefused as e:
                raise FetchRefused(f"{e} (redirect {hop} to {url[:200]})" if hop else str(e)) from None
            r = await self._connect(scheme, host, port, target, addrs)
            try:
                if r.status_code in REDIRECT_STATUSES and r.headers.get("location"):
                    url = urljoin(url, r.headers["location"])
                    continue
                if r.status_code != 200:
                    raise FetchRefused(f"HTTP {r.status_code}")
                return await self._read_body(r)
            finally:
                await r.aclose()
        raise FetchRefused(f"more than {self.policy.max_redirects} redirects")

    async def _connect(self, scheme: str, host: str, port: int, target: str,
                       addrs: list[IPAddress]) -> httpx.Response:
        """GET target from the first of the checked addresses that accepts a connection; the
        URL names the address itself, the Host header (and TLS SNI) the host."""
        default_port = port == (443 if scheme == "https" else 80)
        headers = {"Host": host if default_port else f"{host}:{port}", "Accept": "image/*"}
        extensions = {"sni_hostname": host} if scheme == "https" and parse_ip_literal(host) is None else {}
        client = self._http()
        err: Exception | None = None
        for ip in addrs:
            ip_host = f"[{ip}]" if ip.version == 6 else str(ip)
            request = client.build_request("GET", f"{scheme}://{ip_host}:{port}{target}", headers=headers,
                                           extensions=extensions)
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError as e:
                err = e
        raise err

    async def _read_body(self, r: httpx.Response) -> bytes:
        cap = self.policy.max_bytes
        declared = r.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise FetchRefused(f"Content-Length {declared} is above the {cap} byte limit")
        buf = bytearray()
        async for chunk in r.aiter_bytes():
            if len(buf) + len(chunk) > cap:
                raise FetchRefused(f"body is larger than the {cap} byte limit")
            inflight.charge(len(chunk))     # the 429 (APIError) passes through: the server is full
            buf += chunk
        data = bytes(buf)
        if not looks_like_image(data):
            raise FetchRefused(f"the body ({len(data)} bytes, Content-Type "
                               f"{r.headers.get('content-type')!r}) is not an image")
        return data

    # ------------------------------------------------------------------ local files
    async def _local(self, path: str, label: str) -> bytes:
        root = self.policy.allowed_local_path
        if root is None:
            raise bad_request(f"{label}: local file paths are not allowed (the server was started without "
                              f"--allowed-local-media-path)", param="messages", code="local_path_not_allowed")
        # realpath and stat touch the file system (an NFS mount may stall): off the event loop too
        return await asyncio.to_thread(self._read_local, path, label, root)

    def _read_local(self, path: str, label: str, root: Path) -> bytes:
        try:
            real = Path(os.path.realpath(path))
        except (OSError, ValueError):
            raise bad_request(f"{label}: invalid local path", param="messages") from None
        if real != root and root not in real.parents:
            raise bad_request(f"{label}: {path} is outside --allowed-local-media-path", param="messages",
                              code="local_path_not_allowed")
        try:
            # refuse what is not a regular file before opening it: opening a FIFO for reading
            # blocks until a writer comes; a device never ends
            st = real.stat()
            if stat.S_ISDIR(st.st_mode):
                raise bad_request(f"{label}: {path} is a directory", param="messages")
            if not stat.S_ISREG(st.st_mode):
                raise bad_request(f"{label}: {path} is not a regular file", param="messages")
            self._check_size(st.st_size, label)
            # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, the open
            # returns at once and fstat below refuses it
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise bad_request(f"{label}: {path} is not a regular file", param="messages")
                data = f.read(self.policy.max_bytes + 1)
            self._check_size(len(data), label)
            return data
        except APIError:
            raise
        except FileNotFoundError:
            raise bad_request(f"{label}: file not found: {path}", param="messages") from None
        except OSError as e:
            raise bad_request(f"{label}: cannot read {path} ({e.strerror or e})", param="messages") from None
