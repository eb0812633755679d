"""A server under benchmark: a subprocess on a free loopback port, its output in a log file
(bench serve's sides, the parse workload's server)."""
from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time

from . import BenchError

log = logging.getLogger("fastdeploy_ext.bench.serve")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on a free loopback port; its output goes to a log file."""

    def __init__(self, name: str, cmd: list[str], log_path: str):
        self.name, self.log_path = name, log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd + ["--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)
        log.info("%s: %s (log %s)", name, " ".join(cmd), log_path)

    def wait_healthy(self, timeout: float) -> None:
        import httpx
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise BenchError(f"{self.name} server not healthy after {timeout:g}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
