"""The caller's deadline on the HTTP door (`grpc-timeout`, service/doors/http/deadline.py), through a real
server on 127.0.0.1: a malformed header is 400 naming it, a deadline too short to meet is 504 at the door,
one that passes while the call is queued behind a held model thread is 504 (the thread is released only
after that answer: events decide, not timing), a longer one than default_timeout_s is honoured, and
none leaves the default in force."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from model import faults
from service.doors.http.deadline import timeout_s
from service.errors import NotAcceptable
from tests.support.helpers import Running, ids_request, wait_for

EMBED = ("/v1/embeddings", {"model": "fault-model", "input": [[1, 2]]})
ROUTES = {  # route -> (path, body, the status of an invalid body in its dialect)
    "openai": EMBED,
    "tei": ("/embed", {"inputs": [[1, 2]]}),
    "kserve": ("/v2/models/fault-model/infer",
               {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]}]}),
    "attention": ("/v1/encode", {"sequences": [{"token_ids": {"dtype": "DTYPE_INT64", "shape": [2],
                                                              "data": "AQAAAAAAAAACAAAAAAAAAA=="}}]}),
}


def message(body: dict[str, Any]) -> str:
    error = body["error"]
    return str(error["message"] if isinstance(error, dict) else error)


@pytest.mark.parametrize(("value", "seconds"), [("2S", 2.0), ("500m", 0.5), ("1H", 3600.0), ("3M", 180.0),
                                                ("250u", 250e-6), ("7n", 7e-9), ("99999999S", 99999999.0)])
def test_the_header_is_grpcs_timeout_format(value: str, seconds: float) -> None:
    assert timeout_s([value], 30.0) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "2", "S", "2s", "1.5S", "-1S", "123456789S", "2 S", "2SS", "0x2S"])
def test_a_malformed_header_is_refused_naming_it(value: str) -> None:
    with pytest.raises(NotAcceptable) as info:
        timeout_s([value], 30.0)
    assert info.value.status == 400 and "grpc-timeout" in info.value.message


def test_no_header_is_the_default_and_two_are_refused() -> None:
    assert timeout_s([], 30.0) == 30.0
    with pytest.raises(NotAcceptable, match="grpc-timeout: sent 2 times"):
        timeout_s(["1S", "2S"], 30.0)


async def test_malformed_and_too_short_deadlines_in_every_dialect(start_server: Any, fault_bundle: Path) -> None:
    s = await start_server(bundle=fault_bundle, http_port=0, openai_token_ids=True)  # an ids-only model
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=30) as http:
        for path, body in ROUTES.values():
            ok = await http.post(path, json=body, headers={"grpc-timeout": "10S"})
            assert ok.status_code == 200, (path, ok.text)
            bad = await http.post(path, json=body, headers={"grpc-timeout": "soon"})
            assert bad.status_code == 400, (path, bad.text)  # 400 in TEI's dialect too (not its 422)
            assert "grpc-timeout" in message(bad.json()), (path, bad.text)
            twice = await http.post(path, json=body, headers=[("grpc-timeout", "1S"), ("grpc-timeout", "2S")])
            assert twice.status_code == 400 and "sent 2 times" in message(twice.json()), (path, twice.text)
            # 1 us: gone before the door admits it (under min_deadline_ms): refused with nothing queued.
            short = await http.post(path, json=body, headers={"grpc-timeout": "1u"})
            assert short.status_code == 504, (path, short.text)
            assert "deadline too short" in message(short.json()), (path, short.text)
        openai_short = await http.post(EMBED[0], json=EMBED[1], headers={"grpc-timeout": "1u"})
        assert openai_short.json()["error"]["code"] == "deadline_exceeded"
    assert s.sample("attention_failures_total", {"reason": "deadline_unmeetable"}) == len(ROUTES) + 1
    assert s.sample("attention_requests_total", {"method": "POST /embed", "code": "DEADLINE_EXCEEDED"}) == 1
    assert s.sample("attention_requests_total", {"method": "POST /embed", "code": "INVALID_ARGUMENT"}) == 2
    assert s.sample("attention_sequences_total") == len(ROUTES)  # the refused calls never reached the model


async def test_a_deadline_passes_in_the_queue_a_longer_one_is_honoured_none_is_the_default(
        start_server: Any, fault_bundle: Path) -> None:
    faults.reset()
    s: Running = await start_server(bundle=fault_bundle, http_port=0, model_workers=1, default_timeout_s=0.5,
                                    openai_token_ids=True)  # an ids-only model
    path, body = EMBED
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}", timeout=60) as http:
        held = asyncio.ensure_future(s.stub.Encode(ids_request([faults.HANG, 1]), timeout=60))
        try:
            await asyncio.to_thread(faults.HANG_ENTERED.wait, 10)  # the one model thread is held from here
            patient = asyncio.ensure_future(http.post(path, json=body, headers={"grpc-timeout": "60S"}))
            await wait_for(lambda: s.sample("attention_queue_depth") == 1, 10, "the patient call queued")
            late = await http.post(path, json=body, headers={"grpc-timeout": "100m"})
            assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded", late.text
            # No header: default_timeout_s (0.5 s) bounds it, though the patient call has waited longer.
            default = await http.post(path, json=body)
            assert default.status_code == 504, default.text
            tei = await http.post("/embed", json={"inputs": [[1, 2]]}, headers={"grpc-timeout": "100m"})
            assert tei.status_code == 504 and tei.json()["error_type"] == "Backend", tei.text
            assert not patient.done()
        finally:
            faults.HANG_RELEASE.set()
        assert (await held).outputs
        answer = await patient  # queued well past the default: its own 60 s apply
        assert answer.status_code == 200, answer.text
    await wait_for(lambda: s.sample("attention_requests_total", {
        "method": "POST /v1/embeddings", "code": "DEADLINE_EXCEEDED"}) == 2, 10, "the two 504s counted")
    assert s.sample("attention_dropped_total", {"reason": "deadline"}) + s.sample(
        "attention_failures_total", {"reason": "deadline"}) >= 3
