"""A small Chrome DevTools Protocol client for the browser tests: headless Chromium from the
distribution's packages (never downloaded), one page target, commands over its websocket
(aiohttp's client, already a test dependency)."""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

#: the names Debian/Ubuntu packages install the browser under
BROWSERS = ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """A headless Chromium process with its DevTools endpoint on a free loopback port."""

    def __init__(self, executable: str, width: int = 1280, height: int = 900):
        self.profile = tempfile.mkdtemp(prefix="fdx-chromium-")
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.port = self._devtools_port()

    def _devtools_port(self, deadline_s: float = 60) -> int:
        """Chromium writes the port it bound to DevToolsActivePort in its profile."""
        marker = Path(self.profile) / "DevToolsActivePort"
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            if marker.is_file():
                lines = marker.read_text().splitlines()
                if lines and lines[0].isdigit():
                    return int(lines[0])
            time.sleep(0.1)
        raise RuntimeError("chromium did not open its DevTools port")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab: ``await page.send(method, **params)`` -> the result (a protocol error raises)."""

    def __init__(self, session, ws):
        self.session, self.ws = session, ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, browser: Browser) -> "Page":
        import aiohttp
        session = aiohttp.ClientSession()
        base = f"http://127.0.0.1:{browser.port}"
        async with session.put(f"{base}/json/new?about:blank") as r:
            target = await r.json(content_type=None)
        ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        return cls(session, ws)

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(data)

    async def send(self, method: str, **params):
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        data = await asyncio.wait_for(fut, 60)
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data["result"]

    async def eval(self, expression: str):
        """A JavaScript expression's value (JSON-serialisable; promises awaited)."""
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait_for(self, expression: str, deadline_s: float = 120, every_s: float = 0.2):
        """Polls until the expression is truthy; its value (TimeoutError past the deadline)."""
        end = time.monotonic() + deadline_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"{expression} still falsy after {deadline_s} s")
            await asyncio.sleep(every_s)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for(f"document.readyState === 'complete' && location.href === {json.dumps(url)}")

    async def set_files(self, selector: str, paths: list[str]) -> None:
        root = await self.send("DOM.getDocument")
        node = await self.send("DOM.querySelector", nodeId=root["root"]["nodeId"], selector=selector)
        await self.send("DOM.setFileInputFiles", nodeId=node["nodeId"], files=[os.fspath(p) for p in paths])

    async def hover(self, x: float, y: float) -> None:
        await self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    async def screenshot(self, path: Path) -> bytes:
        res = await self.send("Page.captureScreenshot", format="png")         # the viewport
        data = base64.b64decode(res["data"])
        Path(path).write_bytes(data)
        return data

    async def close(self) -> None:
        self._reader.cancel()
        await self.ws.close()
        await self.session.close()


def is_png(data: bytes) -> tuple[int, int] | None:
    """A PNG's (width, height) from its header, else None."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    m = re.match(rb".{16}(.{4})(.{4})", data, re.S)
    return int.from_bytes(m.group(1), "big"), int.from_bytes(m.group(2), "big")
