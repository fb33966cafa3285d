"""The /metrics endpoint: a registry's families served over HTTP from a thread of their own, one render at
a time and paced, so that scrapes cannot take the process that serves them (docs/metrics.md). The
families themselves are service/metrics.py's."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted

# /metrics renders take the GIL of the process that serves them (with edge processes: the model process,
# summing every process's files per scrape). Back-to-back scrapes kept that process from acting on a
# cancellation for 20 s (and took 0.7-0.95 of a core from it: docs/metrics.md). So scrapes render one at
# a time, in their order of arrival, and each render starts no sooner than SCRAPE_GAP_FACTOR times the last
# render's duration after it (at least SCRAPE_MIN_GAP_S, at most SCRAPE_MAX_GAP_S): renders take at most
# 1 / (1 + 4) of the time however fast scrapes come, and a closed loop of scrapers is slowed to that pace.
# Scrapes beyond SCRAPE_MAX_WAITING waiting their turn are answered 503 after SCRAPE_REFUSE_DELAY_S, which
# slows a closed loop of refused scrapers too (each refusal costs a thread and a parse in this process).
SCRAPE_GAP_FACTOR = 4.0
SCRAPE_MIN_GAP_S = 0.02
SCRAPE_MAX_GAP_S = 2.0
SCRAPE_MAX_WAITING = 64
SCRAPE_REFUSE_DELAY_S = 1.0


class ScrapeGate:
    """The /metrics WSGI app of `registry` (as prometheus_client's `make_wsgi_app`: any path, the text or
    OpenMetrics format as the Accept header asks, gzip when accepted, `name[]` to restrict), with the
    bounds above. Every answer is rendered after its request arrived: never a stale copy."""

    def __init__(self, registry: CollectorRegistry, *, gap_factor: float = SCRAPE_GAP_FACTOR,
                 min_gap_s: float = SCRAPE_MIN_GAP_S, max_gap_s: float = SCRAPE_MAX_GAP_S,
                 max_waiting: int = SCRAPE_MAX_WAITING, refuse_delay_s: float = SCRAPE_REFUSE_DELAY_S) -> None:
        self._registry = registry
        self._gap_factor = gap_factor
        self._min_gap_s = min_gap_s
        self._max_gap_s = max_gap_s
        self._max_waiting = max_waiting
        self._refuse_delay_s = refuse_delay_s
        self._mutex = threading.Lock()
        self._rendering = False
        self._waiting: deque[threading.Event] = deque()  # in order of arrival; set: your turn
        self._next_start = 0.0  # time.monotonic() before which no render starts
        self.renders = 0
        self.refused = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "OPTIONS":
            return _answer(start_response, "200 OK", [("Allow", "OPTIONS,GET")], b"")
        if method != "GET":
            return _answer(start_response, "405 Method Not Allowed", [("Allow", "OPTIONS,GET")],
                           f"# HTTP 405 Method Not Allowed: {method}; use OPTIONS or GET\n".encode())
        if environ.get("PATH_INFO") == "/favicon.ico":
            return _answer(start_response, "200 OK", [], b"")
        if not self._take_turn():
            time.sleep(self._refuse_delay_s)  # no GIL held: a closed loop of refused scrapers slows down
            return _answer(start_response, "503 Service Unavailable", [("Retry-After", "1"), (
                "Content-Type", "text/plain; charset=utf-8")], b"too many concurrent /metrics scrapes; retry\n")
        try:
            pause = self._next_start - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            started = time.monotonic()
            headers, body = self._bake(environ)
            took = time.monotonic() - started
            self._next_start = time.monotonic() + min(max(self._gap_factor * took, self._min_gap_s), self._max_gap_s)
            self.renders += 1
        finally:
            self._pass_turn()
        return _answer(start_response, "200 OK", headers, body)

    def _take_turn(self) -> bool:
        """Wait (GIL released) until this scrape may render; False when too many already wait."""
        with self._mutex:
            if not self._rendering:
                self._rendering = True
                return True
            if len(self._waiting) >= self._max_waiting:
                self.refused += 1
                return False
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()
        return True

    def _pass_turn(self) -> None:
        with self._mutex:
            if self._waiting:
                self._waiting.popleft().set()  # still rendering: the turn goes to the next in line
            else:
                self._rendering = False

    def _bake(self, environ: dict[str, Any]) -> tuple[list[tuple[str, str]], bytes]:
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        body = encoder(self._registry.restricted_registry(names) if names else self._registry)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        return headers, body


def _answer(start_response: Any, status: str, headers: list[tuple[str, str]], body: bytes) -> list[bytes]:
    start_response(status, headers)
    return [body]


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape (prometheus_client's server logs none either)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """`ScrapeGate(registry)` served on host:port (0: a free port) from a daemon thread, a thread per
    request, as prometheus_client's `start_http_server` serves (IPv6 hosts included). The server has
    `server_port`, `shutdown()` and `server_close()`; OSError when the port cannot be had."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": info[0]})
    httpd: WSGIServer = make_server(str(info[4][0]), port, ScrapeGate(registry), server_class, _QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
