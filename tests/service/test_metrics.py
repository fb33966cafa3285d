"""Metrics: names and labels pinned, injected registries, NaN/Inf observable end to end, and a real
Prometheus server scraping a real service."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from model import faults
from proto.attention.v1.codec import from_tensor
from service.metrics import DROP_REASONS, FAILURE_REASONS, Metrics, metric_families
from service.process_metrics import ProcessMetrics
from tests.support.helpers import Running, ids_request, wait_for
from tests.support.prometheus_server import prometheus_server
from tests.support.server_process import ServerProcess

# The contract with dashboards and alerts (deploy/; tests/deploy/test_deploy.py reads it through
# service.metrics.metric_families): a rename must be a conscious change here too.
PINNED = {
    "attention_request_duration_seconds": ("histogram", {"method", "code", "model"}),
    "attention_queue_duration_seconds": ("histogram", {"model"}),
    "attention_compute_duration_seconds": ("histogram", {"precision", "model"}),
    "attention_batch_size": ("histogram", {"model"}),
    "attention_batch_tokens": ("histogram", {"model"}),
    "attention_padding_ratio": ("histogram", {"model"}),
    "attention_queue_depth": ("gauge", {"model"}),
    "attention_queue_tokens": ("gauge", {"model"}),
    "attention_queue_limit_tokens": ("gauge", {"model"}),
    "attention_ready": ("gauge", set()),
    "attention_model_info": ("gauge", {"name", "version", "device", "precision", "precision_source", "model"}),
    "attention_warmup_forward_seconds": ("gauge", {"precision", "model"}),
    "attention_batch_tokens_limit": ("gauge", {"source", "model"}),
    "attention_model_workers": ("gauge", {"source"}),
    "attention_warmup_tokens_per_second": ("gauge", {"batch_tokens", "model"}),
    "attention_requests_total": ("counter", {"method", "code", "model"}),
    "attention_sequences_total": ("counter", {"model"}),
    "attention_nonfinite_outputs_total": ("counter", {"precision", "model"}),
    "attention_fp32_retries_total": ("counter", {"model"}),
    "attention_nonfinite_inputs_total": ("counter", set()),
    "attention_failures_total": ("counter", {"reason"}),
    "attention_dropped_total": ("counter", {"reason", "model"}),
    "attention_batch_splits_total": ("counter", {"reason", "model"}),
    "attention_batches_total": ("counter", {"width", "model"}),
    "attention_auth_failures_total": ("counter", {"reason"}),
    "attention_score_max_abs": ("histogram", {"layer", "model"}),
    "attention_entropy_normalized": ("histogram", {"layer", "model"}),
    "attention_score_overflow_risk_total": ("counter", {"layer", "model"}),
    "attention_entropy_baseline": ("gauge", {"layer", "model"}),
    "attention_diagnostics_enabled": ("gauge", {"model"}),
    "grpc_server_started_total": ("counter", {"grpc_type", "grpc_service", "grpc_method"}),
    "grpc_server_handled_total": ("counter", {"grpc_type", "grpc_service", "grpc_method", "grpc_code"}),
    "grpc_server_handling_seconds": ("histogram", {"grpc_type", "grpc_service", "grpc_method"}),
    # Each process's own (service/process_metrics.py): prometheus_client's standard names, labelled by process.
    "process_cpu_seconds_total": ("counter", {"process"}),
    "process_resident_memory_bytes": ("gauge", {"process"}),
    "process_virtual_memory_bytes": ("gauge", {"process"}),
    "process_start_time_seconds": ("gauge", {"process"}),
    "process_open_fds": ("gauge", {"process"}),
    "process_max_fds": ("gauge", {"process"}),
    "python_gc_objects_collected_total": ("counter", {"generation", "process"}),
    "python_gc_objects_uncollectable_total": ("counter", {"generation", "process"}),
    "python_gc_collections_total": ("counter", {"generation", "process"}),
    "python_info": ("gauge", {"implementation", "major", "minor", "patchlevel", "version", "process"}),
}


def test_metric_names_types_and_labels_are_pinned():
    assert {name: (kind, set(labels)) for name, (kind, labels) in metric_families().items()} == PINNED
    registry = CollectorRegistry()
    Metrics(registry)
    registry.register(ProcessMetrics("server"))
    exposed = {family.name for family in registry.collect()}
    assert {name.removesuffix("_total") for name in PINNED} == exposed  # nothing /metrics serves is left out


def test_two_metric_sets_in_one_process_do_not_collide():
    Metrics(CollectorRegistry())
    Metrics(CollectorRegistry())  # module-global metrics would raise "Duplicated timeseries" here


async def test_requests_are_counted_by_method_and_code_and_served_over_http(start_server):
    s = await start_server(metrics_port=0)
    await s.stub.Encode(ids_request([1, 2, 3]), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError):
        await s.stub.Encode(ids_request([1000]), timeout=10)
    assert s.sample("attention_requests_total", {"method": "Encode", "code": "OK"}) == 1
    labels = {"grpc_type": "unary", "grpc_service": "attention.v1.AttentionService", "grpc_method": "Encode"}
    # grpcio sends an aborted call's status before the handler's `finally` (which counts it) runs, so the
    # caller can have its error a moment before the counters move.
    await wait_for(lambda: s.sample("attention_requests_total", {"method": "Encode", "code": "INVALID_ARGUMENT"}) == 1
                   and s.sample("grpc_server_handled_total", {**labels, "grpc_code": "INVALID_ARGUMENT"}) == 1,
                   what="the failed call counted")
    assert s.sample("grpc_server_started_total", labels) == 2
    assert s.sample("attention_ready") == 1
    assert s.sample("attention_model_info", {"name": "tiny", "version": "1", "device": "cpu", "precision": "fp32",
                                             "precision_source": "configured", "model": "tiny"}) == 1
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read())
    assert b'attention_requests_total{code="OK",method="Encode",model="tiny"} 1.0' in text  # the model it ran on
    assert b"attention_request_duration_seconds_bucket" in text


async def test_nonfinite_outputs_are_rerun_in_fp32_and_counted_exactly(start_server, fault_bundle, tiny_bundle):
    s: Running = await start_server(bundle=fault_bundle, precision="bf16")
    clean = np.array([5, 6, 7, 8])
    nan_a, nan_b = np.array([5, faults.NAN_ROW, 7]), np.array([faults.NAN_ROW, 1])
    response = await s.stub.Encode(ids_request(nan_a, clean, nan_b), timeout=30)
    assert [o.nonfinite for o in response.outputs] == [True, False, True]
    assert response.metadata.fp32_retry and response.metadata.precision == "bf16"
    for out in response.outputs:
        assert np.isfinite(from_tensor(out.hidden)).all()
    # The re-run is fp32: it equals an fp32 server's answer for the same sequence.
    fp32 = await start_server(bundle=fault_bundle, precision="fp32")
    expected = await fp32.stub.Encode(ids_request(nan_a), timeout=30)
    np.testing.assert_allclose(from_tensor(response.outputs[0].hidden), from_tensor(expected.outputs[0].hidden),
                               atol=1e-5)
    assert s.sample("attention_nonfinite_outputs_total", {"precision": "bf16"}) == 2
    assert s.sample("attention_fp32_retries_total") == 2
    # NaN in every precision: the caller gets INTERNAL, never a NaN.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(ids_request(clean, [faults.NAN_ALWAYS, 3]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "non-finite model output (ref=" in info.value.details()
    assert s.sample("attention_nonfinite_outputs_total", {"precision": "bf16"}) == 3
    assert s.sample("attention_nonfinite_outputs_total", {"precision": "fp32"}) == 0  # the retry is not counted twice
    assert s.sample("attention_failures_total", {"reason": "nonfinite_output"}) == 1


async def test_fail_policy_answers_internal_and_counts(start_server, fault_bundle):
    s: Running = await start_server(bundle=fault_bundle, precision="bf16", nonfinite_policy="fail")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.stub.Encode(ids_request([faults.NAN_ROW, 2]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert s.sample("attention_nonfinite_outputs_total", {"precision": "bf16"}) == 1
    assert s.sample("attention_fp32_retries_total") == 0


@pytest.mark.slow
async def test_real_prometheus_scrapes_latency_codes_and_nonfinite_counts(start_server, fault_bundle):
    s: Running = await start_server(bundle=fault_bundle, precision="bf16", metrics_port=0)
    rng = np.random.default_rng(0)
    for _ in range(5):
        await asyncio.gather(*(s.stub.Encode(ids_request(rng.integers(0, 90, rng.integers(1, 64))), timeout=30)
                               for _ in range(8)))
    for bad in ([1000], [-1]):
        with pytest.raises(grpc.aio.AioRpcError):
            await s.stub.Encode(ids_request(bad), timeout=10)
    await s.stub.Encode(ids_request([faults.NAN_ROW, 3], [faults.NAN_ROW]), timeout=30)

    with prometheus_server([f"127.0.0.1:{s.server.metrics_port}"]) as prom:
        def wait(expr: str, predicate):
            return asyncio.to_thread(prom.wait_for, expr, predicate, 60.0)

        ok = await wait('sum(attention_requests_total{job="attention",code="OK"})', lambda r: r and r[0].value == 41)
        assert ok[0].value == 41
        bad = await wait('sum(attention_requests_total{code="INVALID_ARGUMENT"})', lambda r: r and r[0].value == 2)
        assert bad[0].value == 2
        # 40 plain calls, 2 invalid ones and the NaN call: the p99 over the request histogram is a real
        # latency in seconds between the first and the last bucket bounds.
        p99 = await wait(
            "histogram_quantile(0.99, sum by (le) (attention_request_duration_seconds_bucket))",
            lambda r: r and r[0].value == r[0].value,  # not NaN
        )
        assert 0 < p99[0].value <= 10.0
        nonfinite = await wait('attention_nonfinite_outputs_total{precision="bf16"}', lambda r: r and r[0].value == 2)
        assert nonfinite[0].value == 2
        # The serving process's own health (service/process_metrics.py), under the standard names.
        rss = await wait('process_resident_memory_bytes{job="attention"}', lambda r: r and r[0].value > 0)
        assert [r.labels["process"] for r in rss] == ["server"]
        handled = await wait('grpc_server_handled_total{grpc_method="Encode",grpc_code="OK"}',
                             lambda r: r and r[0].value == 41)
        assert handled[0].labels["grpc_service"] == "attention.v1.AttentionService"


@pytest.mark.parametrize("mode", [(), ("--edge-processes", "1")], ids=["one-process", "edge-processes"])
def test_failure_and_drop_counters_exist_at_zero_on_a_fresh_server(tiny_bundle: Path, tmp_path: Path,
                                                                     mode: tuple[str, ...]):
    """Issue 27: attention_failures_total and attention_dropped_total had no series before their first
    event, so a dashboard panel read "No data" on a healthy service."""
    server = ServerProcess(tiny_bundle, *mode, directory=tmp_path)
    try:
        samples = server.scrape()
    finally:
        assert server.terminate() == 0
    for name, reasons in (("attention_failures_total", FAILURE_REASONS), ("attention_dropped_total", DROP_REASONS)):
        seen = {dict(labels)["reason"]: value for (sample, labels), value in samples.items() if sample == name}
        assert seen == dict.fromkeys(reasons, 0.0), (name, seen)
    assert {"queue_full", "deadline", "internal", "unauthenticated"} <= set(FAILURE_REASONS)


def test_every_drop_reason_the_batcher_reports_is_initialised():
    """DROP_REASONS is what service/batching/ passes to on_dropped, read from its source."""
    import re

    from service.batching import batcher

    source = "".join(path.read_text() for path in Path(batcher.__file__).parent.glob("*.py"))
    reported = set(re.findall(r'on_dropped\("(\w+)"', source)) | set(re.findall(r'dropped\["(\w+)" if', source))
    reported |= set(re.findall(r'else "(\w+)"\] \+= 1', source))
    assert reported == set(DROP_REASONS), reported
