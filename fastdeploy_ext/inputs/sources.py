"""Which kind of location a user-given image string names, read one way for every entry point
(the server's media fetcher and the engine's `inputs.images.resolve_source`), so that a value can
never be a data URL in one place and a relative path in the other.

URL schemes are case-insensitive (RFC 3986 3.1): ``DATA:``, ``Data:``, ``FILE://`` and ``HTTP://``
are ``data:``, ``file://`` and ``http://``. A string is a URL only when it starts with ``data:``
or with ``<scheme>://``; anything else (``page:1.png`` included) is a local path, as before."""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")

DATA, HTTP, HTTPS, FILE, PATH = "data", "http", "https", "file", ""


@dataclass(frozen=True)
class Source:
    """``scheme``: lower-case (``PATH`` == "" for a plain path, or any other scheme, lower-cased,
    for the caller to refuse); ``path``: the local path a plain path or a ``file://`` URL names
    (percent-decoded; an optional ``localhost`` host dropped), None for the other schemes."""
    scheme: str
    path: str | None = None


def parse_source(value: str) -> Source:
    m = _SCHEME.match(value)
    if m is not None:
        scheme, rest = m.group(1).lower(), value[m.end():]
        if scheme == DATA:
            return Source(DATA)
        if rest.startswith("//"):
            if scheme == FILE:
                return Source(FILE, _file_url_path(rest[2:]))
            return Source(scheme)
    return Source(PATH, value)


def _file_url_path(rest: str) -> str:
    """``file://`` + rest -> the path: ``file:///abs`` and ``file://localhost/abs`` are /abs (RFC
    8089); ``file://rel/x`` names the relative path rel/x, as resolve_source always read it."""
    if rest[:10].lower() == "localhost/":
        rest = rest[9:]
    return unquote(rest)


def data_url_head(url: str) -> tuple[str, str] | None:
    """``data:<mediatype>[;base64],<payload>`` -> (the part between ``data:`` and the comma,
    lower-cased; the payload), or None when it is not a data URL with a comma."""
    if parse_source(url).scheme != DATA:
        return None
    head, sep, payload = url[len("data:"):].partition(",")
    return (head.lower(), payload) if sep else None
