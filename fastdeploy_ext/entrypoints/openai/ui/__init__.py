"""``/ui`` on `serve`: one static page (index.html, plain JavaScript, no external assets) that
uploads a document through the job API and shows each page's layout beside its Markdown."""
from __future__ import annotations

import functools
from importlib import resources

PATH = "/ui"


@functools.lru_cache(maxsize=1)
def page() -> bytes:
    return resources.files(__package__).joinpath("index.html").read_bytes()


def mount(app) -> None:
    from starlette.responses import Response

    @app.get(PATH)
    async def ui():
        # the page talks to this server only; it must not be framed by another site
        return Response(page(), media_type="text/html; charset=utf-8",
                        headers={"X-Frame-Options": "DENY", "Cache-Control": "no-cache",
                                 "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; "
                                 "style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                                 "frame-ancestors 'none'"})
