"""A hand-driven HTTP/2 client (PyPI `h2` over a plain socket to 127.0.0.1) for frames grpcio never
sends: floods of header-only streams, and a gRPC message that never completes.

Synchronous and bounded: every loop stops at a count or a monotonic deadline, and every socket read
has a timeout. Tests run it in a thread (`asyncio.to_thread`) when the server shares their loop.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
from hyperframe.frame import HeadersFrame

SERVICE = "/attention.v1.AttentionService"


def grpc_headers(port: int, method: str = "Encode") -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", f"{SERVICE}/{method}"),
            (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"), ("te", "trailers")]


@dataclass
class StreamEnd:
    """How a stream ended, as the client saw it."""

    how: str  # "trailers" (a gRPC status), "reset" (RST_STREAM), "goaway", "closed" (connection), "timeout"
    grpc_status: str | None = None
    error_code: int | None = None
    seconds: float = 0.0
    events: list[str] = field(default_factory=list)
    goaway_text: bytes = b""  # GOAWAY debug data: grpc core says why ("max_idle", "max_age", ...)


class RawH2:
    """One HTTP/2 connection. `flood` ignores the server's SETTINGS on purpose (an attacker does), so
    h2 sends past SETTINGS_MAX_CONCURRENT_STREAMS; `call_incomplete` plays by the rules."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self._flush()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def flood(self, streams: int, seconds: float, batch: int = 1000) -> int:
        """Open up to `streams` header-only streams (no message, no END_STREAM) within `seconds`,
        ignoring SETTINGS_MAX_CONCURRENT_STREAMS; returns how many were sent. What the server answers
        is read and discarded. The connection is for nothing else afterwards (h2 never saw these
        streams: its per-stream bookkeeping is quadratic, 40 s for 20,000 of them)."""
        end = time.monotonic() + seconds
        headers = grpc_headers(self.port)
        self.conn.send_headers(self.conn.get_next_available_stream_id(), headers)  # fills the HPACK table
        self._flush()
        block = self.conn.encoder.encode(headers)  # now all indexed: the same bytes for every stream
        stream_id, sent = self.conn.highest_outbound_stream_id + 2, 1
        try:
            while sent < streams and time.monotonic() < end:
                frames = []
                for _ in range(min(batch, streams - sent)):
                    frames.append(HeadersFrame(stream_id, data=block, flags=["END_HEADERS"]).serialize())
                    stream_id += 2
                self.sock.sendall(b"".join(frames))
                sent += len(frames)
                self.drain(0.0)
        except (BrokenPipeError, ConnectionResetError):  # the server closed this connection: flood over
            pass
        return sent

    def drain(self, seconds: float) -> int:
        """Read and discard what the server sends for up to `seconds`; returns the bytes read
        (0 and stops early when the connection is closed)."""
        end = time.monotonic() + seconds
        total = 0
        self.sock.settimeout(0.0 if seconds == 0 else 0.05)
        try:
            while True:
                try:
                    data = self.sock.recv(1 << 16)
                except (BlockingIOError, TimeoutError):
                    if time.monotonic() >= end:
                        break
                    continue
                except ConnectionResetError:
                    break
                if not data:
                    break
                total += len(data)
        finally:
            self.sock.settimeout(5.0)
        return total

    def call_incomplete(self, *, declared: int = 1000, sent: int = 10, end_stream: bool = True,
                        method: str = "Encode", timeout: float = 30.0) -> StreamEnd:
        """One gRPC call with no deadline whose message declares `declared` bytes and carries `sent`,
        then END_STREAM (or the stream left open). Waits up to `timeout` for the stream to end: its
        trailers, its RST_STREAM, a GOAWAY that excludes it, or the connection closing. A GOAWAY that
        includes it is not an end (the stream may still finish in the grace period): reading goes on,
        raw, to the close (h2 accepts nothing after a GOAWAY)."""
        started = time.monotonic()
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, grpc_headers(self.port, method))
        self.conn.send_data(stream_id, struct.pack(">BI", 0, declared) + bytes(sent), end_stream=end_stream)
        self._flush()
        seen: list[str] = []
        status: str | None = None
        goaway = b""
        parsing = True

        def end(how: str, error_code: int | None = None) -> StreamEnd:
            return StreamEnd(how, status, error_code, time.monotonic() - started, seen, goaway)

        while (left := started + timeout - time.monotonic()) > 0:
            self.sock.settimeout(min(left, 1.0))
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                return end("closed")
            if not parsing:
                continue
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:  # frames after a GOAWAY (a PING): read on, raw
                seen.append("ProtocolError")
                parsing = False
                continue
            self._flush()  # SETTINGS and PING acknowledgements
            for event in events:
                seen.append(type(event).__name__)
                if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    status = dict(event.headers).get("grpc-status", status)  # type: ignore[arg-type]
                if isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream_id:
                    return end("trailers")
                if isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                    return end("trailers")  # trailers-only: the status came with the headers
                if isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                    return end("reset", int(event.error_code))
                if isinstance(event, h2.events.ConnectionTerminated):
                    goaway = event.additional_data or b""
                    if event.last_stream_id is not None and event.last_stream_id < stream_id:
                        return end("goaway", int(event.error_code))
                    parsing = False
        return end("timeout")

    def wait_goaway(self, timeout: float) -> StreamEnd:
        """Read (acknowledging SETTINGS and PINGs, as a live client does) until the server sends
        GOAWAY or closes the connection, for up to `timeout` seconds."""
        started = time.monotonic()
        seen: list[str] = []
        while (left := started + timeout - time.monotonic()) > 0:
            self.sock.settimeout(min(left, 1.0))
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                return StreamEnd("closed", seconds=time.monotonic() - started, events=seen)
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:  # a frame after the GOAWAY in the same read
                return StreamEnd("goaway", seconds=time.monotonic() - started, events=[*seen, "ProtocolError"])
            self._flush()
            for event in events:
                seen.append(type(event).__name__)
                if isinstance(event, h2.events.ConnectionTerminated):
                    return StreamEnd("goaway", error_code=int(event.error_code), seconds=time.monotonic() - started,
                                     events=seen, goaway_text=event.additional_data or b"")
        return StreamEnd("timeout", seconds=time.monotonic() - started, events=seen)

    def read_until_closed(self, timeout: float) -> bool:
        """Read raw, answering nothing (no PING or SETTINGS acknowledgement: a dead or stuck peer),
        until the server closes the connection (True) or `timeout` seconds pass (False)."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(min(left, 1.0))
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except TimeoutError:
                continue
            except ConnectionResetError:
                return True
        return False
