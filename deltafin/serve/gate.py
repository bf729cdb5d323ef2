"""The server's door: bodies read whole under a size limit and a deadline, connections that never finish
their headers closed, and server-side paths kept out of what clients read.

Reading the body before the route runs means a route never sees a half-read body: a chunked upload over
the limit is a 413 however it is framed, a client that stops sending is a 408, and one that hangs up
mid-upload simply ends the exchange (nothing to answer, nothing logged as a failure).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class ClientLeft(Exception):
    pass


async def read_body(receive, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body, counted as it arrives (Content-Length or chunked alike)."""
    parts, seen = [], 0

    async def pull() -> None:
        nonlocal seen
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientLeft()
            chunk = msg.get("body", b"")
            seen += len(chunk)
            if seen > max_bytes:
                raise BodyTooLarge()
            parts.append(chunk)
            if not msg.get("more_body", False):
                return

    try:
        await asyncio.wait_for(pull(), timeout_s)
    except TimeoutError:
        raise BodyTimeout() from None
    return b"".join(parts)


def replay(body: bytes, receive):
    """An ASGI receive that hands out ``body`` once, then waits on the real one (to see a disconnect)."""
    sent = [False]

    async def receive_again():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers: uvicorn times out idle keep-alive
    connections, but not one that connects and never sends (or trickles) its request line and headers."""

    headers_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_headers_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_headers_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_headers_deadline()
        super().connection_lost(exc)

    def _arm_headers_deadline(self) -> None:
        self._disarm_headers_deadline()
        if not self.transport.is_closing():
            self._headers_deadline = self.loop.call_later(self.headers_timeout_s, self._headers_late)

    def _disarm_headers_deadline(self) -> None:
        timer = getattr(self, "_headers_deadline", None)
        if timer is not None:
            timer.cancel()
        self._headers_deadline = None

    def _headers_late(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, idle_timeout_s: float = 5.0,
                   headers_timeout_s: float = 10.0, **kw):
    """uvicorn settings shared by ``deltafin serve`` and the tests: the guarded h11 protocol, keep-alive
    connections closed after ``idle_timeout_s`` without a request, headers due within ``headers_timeout_s``."""
    import uvicorn

    protocol = type("Guarded", (GuardedH11,), {"headers_timeout_s": headers_timeout_s})
    kw.setdefault("log_level", "warning")
    return uvicorn.Config(app, host=host, port=port, http=protocol, timeout_keep_alive=idle_timeout_s,
                          h11_max_incomplete_event_size=64 * 1024, **kw)
