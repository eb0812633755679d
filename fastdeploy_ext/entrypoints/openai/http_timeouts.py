"""Connection-level timeouts uvicorn does not have: a request's headers must arrive within
``--header-timeout`` seconds and its body within ``--body-timeout`` seconds of the headers.

uvicorn (h11) waits forever for a request that is being sent slowly: a client that opens a
connection and sends nothing, or half its headers, or a Content-Length it never delivers, holds
a connection (and, for a body, a request task) for as long as it likes; enough of them exhaust
the server's file descriptors (the classic slow-loris). uvicorn's keep-alive timer covers only
an idle connection after a response, and is cancelled by the first byte of the next request.

`timed_h11_protocol` builds an `H11Protocol` subclass with two timers: the header timer runs
from the connection's start (and from the first byte of each following request on a kept-alive
connection) until h11 has parsed the request line and headers; the body timer from there until
the body's last byte. Either firing answers 408 (when no response has started) and closes the
connection; the request's app, if one runs, then sees ``http.disconnect``."""
from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("fastdeploy_ext.server")


def _timeout_response(what: str, seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"the request's {what} did not arrive within {seconds:g} s "
                                            f"(--{what}-timeout); closing the connection",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class TimedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def connection_made(self, transport):
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._timed_cycle = None          # the request whose headers the body timer follows
        self._arm("header", self.header_timeout)

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._timer is None and self._awaiting_headers():
            self._arm("header", self.header_timeout)       # the next request on a kept-alive connection
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not self._timed_cycle:
            self._timed_cycle = cycle                       # its headers are in
            self._disarm()
            if cycle.more_body:
                self._arm("body", self.body_timeout)
        elif cycle is not None and not cycle.more_body and self._timer is not None and not self._awaiting_headers():
            self._disarm()                                  # the body is complete

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def _expired(self, what: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        log.warning("closing the connection from %s: its request %s did not arrive within %g s (--%s-timeout)",
                    "%s:%d" % self.client if self.client else "?", "headers" if what == "header" else "body",
                    seconds, what)
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(_timeout_response(what, seconds))
        self.transport.close()


def timed_h11_protocol(header_timeout: float, body_timeout: float) -> type[TimedH11Protocol]:
    """An H11Protocol class with these timeouts (uvicorn.Config(http=...) takes a class)."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
