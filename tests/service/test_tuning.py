"""Choices from a measurement at warm-up (service/tuning.py): the precision for precision=auto on CPU
and the batch budget for max_batch_tokens=0. The accuracy gate (on service/calibration.py's inputs) and
the choice rules are deterministic and tested as such (with real tiny models, the timing injected where a
test needs a reduced precision fast enough to be checked); what a measurement picks on this machine is not
asserted, only that a choice is made, explained and reported (timings belong in bench/RESULTS.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from model import faults
from model.bundle import save_bundle
from model.config import TINY
from model.encoder import Encoder
from proto.attention.v1 import attention_pb2 as pb
from service.calibration import BatchOutputs
from service.config import ServiceConfig
from service.engine import batch_budget, batch_limits
from service.jobs import Job, ModelSpec, Output
from service.metrics import Metrics
from service.multiproc import frames
from service.runner import Runner
from service.tuning import (
    PRECISION_BOUNDS,
    Bound,
    Fidelity,
    batch_shapes,
    choose_batch_tokens,
    choose_precision,
    fastest_times,
    fidelity,
    round_ratios,
    timed_rounds,
)
from tests.support.helpers import ids_request, test_config

CLOSE = Fidelity(pooled_cosine=0.99999, token_cosine=0.99998, hidden_error=0.001)


def _runner(bundle: Path, **overrides: object) -> Runner:
    config = test_config(bundle, **overrides)
    return Runner(config, str(bundle), Metrics(CollectorRegistry()), workers=1)


@pytest.fixture(scope="module")
def overflowing_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY with embeddings scaled by 1e4: in bf16 (8 bits of mantissa) its hidden states drift far beyond the
    bound (relative error 0.25 measured, bound 0.03), as no trained model's should."""
    model = Encoder(TINY).init_weights(0)
    with torch.no_grad():
        model.tok_emb.weight.mul_(1e4)
    path = tmp_path_factory.mktemp("bundles") / "overflowing"
    save_bundle(model, path, name="overflowing", version="1", source="seed:0 x1e4")
    return path


MS = {"fp32": 40.0, "bf16": 10.0, "fp16": 20.0}


def test_the_fastest_precision_within_the_bounds_is_chosen():
    choice = choose_precision({"bf16": [0.25, 0.2, 0.3], "fp16": [0.5, 0.5, 0.6]}, {"bf16": CLOSE, "fp16": CLOSE},
                              "4x128", MS, calibrated="62 texts")
    assert choice.precision == "bf16" and choice.forward_ms == MS
    assert choice.reason.startswith("measured at warm-up on 4x128 (median forward: fp32 40.0 ms, bf16 10.0 ms")
    assert ("bf16 4.00x fp32's speed (the median of 3 rounds' ratios, 3.33-5.00x); on 62 texts: pooled cosine "
            "0.999990, token cosine 0.999980, hidden error 0.001") in choice.reason
    assert "fp16 2.00x" in choice.reason
    assert choice.fidelity == {"finite": 1.0, "pooled_cosine": 0.99999, "token_cosine": 0.99998, "hidden_error": 0.001}


def test_a_faster_precision_beyond_the_bound_is_refused():
    far = dataclasses.replace(CLOSE, pooled_cosine=0.99)  # the pooled cosine alone fails bf16's bound
    choice = choose_precision({"bf16": [0.25]}, {"bf16": far}, "4x128", MS, calibrated="62 texts")
    assert choice.precision == "fp32" and choice.fidelity == {}
    assert "bf16 refused: differs from fp32 beyond the bound on 62 texts (pooled cosine 0.990000 vs >= 0.9995)" \
        in choice.reason
    assert choose_precision({"fp16": [0.25]}, {"fp16": Fidelity(finite=False)}, "x", MS).precision == "fp32"
    swapped = dataclasses.replace(CLOSE, score_error=0.001, rank_swaps=2)  # scores close, but their order changed
    refused = choose_precision({"bf16": [0.25]}, {"bf16": swapped}, "x", MS)
    assert refused.precision == "fp32" and "(rank swaps 2 vs <= 0)" in refused.reason
    unchecked = choose_precision({"bf16": [0.25]}, {}, "x", MS)  # fast, but the gate did not run on it
    assert unchecked.precision == "fp32" and "bf16 refused: 4.00x fp32's speed but not checked" in unchecked.reason


def test_a_gain_within_the_noise_does_not_buy_a_reduced_precision():
    choice = choose_precision({"bf16": [0.9, 0.95, 1.0]}, {"bf16": CLOSE}, "4x128", MS)
    assert choice.precision == "fp32" and "bf16 not chosen: 1.05x" in choice.reason


def test_the_median_of_the_rounds_ratios_decides_not_one_disturbed_round():
    """bf16 twice as fast as fp32 when undisturbed (0.02 s against 0.04 s). Other work landing on one round
    moves that round's ratio only; and where it drifts between rounds, so that fp32 got the one quiet call
    and bf16 none, the fastest call of each would choose fp32, the rounds' ratios still see bf16 2x."""
    times = {"fp32": [0.40, 0.04, 0.08, 0.04], "bf16": [0.20, 0.40, 0.04, 0.02]}
    ratios = round_ratios(times, "fp32")
    assert ratios == {"bf16": pytest.approx([0.5, 10.0, 0.5, 0.5])}
    assert choose_precision(ratios, {"bf16": CLOSE}, "x", MS).precision == "bf16"
    # Round 1: fp32 quiet, bf16 slowed 3x; rounds 2-4: both slowed alike, by 10x, 3x and 20x.
    drifting = {"fp32": [0.04, 0.40, 0.12, 0.80], "bf16": [0.06, 0.20, 0.06, 0.40]}
    assert min(drifting["fp32"]) < min(drifting["bf16"])
    choice = choose_precision(round_ratios(drifting, "fp32"), {"bf16": CLOSE}, "x", MS)
    assert choice.precision == "bf16" and "bf16 2.00x fp32's speed (the median of 4 rounds' ratios, 0.67-2.00x)" \
        in choice.reason


def test_a_precision_timed_by_one_call_says_so():
    choice = choose_precision({"fp16": [4.0]}, {"fp16": CLOSE}, "x", MS)
    assert choice.precision == "fp32"
    assert "fp16 not chosen: 0.25x fp32's speed (its second call against fp32's, not timed further" in choice.reason


def _outputs(hidden: torch.Tensor, lengths: list[int], **heads: torch.Tensor) -> list[BatchOutputs]:
    return [BatchOutputs(list(range(hidden.shape[0])), torch.tensor(lengths), hidden, heads)]


def test_fidelity_measures_every_output_on_real_tokens_only():
    want = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    got = want.clone()
    got[1, 3:] = 1e6  # padding: ignored
    lengths = [5, 3]
    same = fidelity(_outputs(got, lengths), _outputs(want, lengths), [], PRECISION_BOUNDS["bf16"])
    assert same.finite and same.hidden_error == 0 and same.pooled_cosine == pytest.approx(1.0)
    assert same.measures().keys() == {"finite", "pooled_cosine", "token_cosine", "hidden_error"}  # no heads
    got[0, 1] = -want[0, 1]  # one real token turned round: its cosine -1; the first token and the others agree
    off = fidelity(_outputs(got, lengths), _outputs(want, lengths), [], PRECISION_BOUNDS["bf16"])
    assert off.token_cosine == pytest.approx(-1.0) and off.hidden_error > 0.5 and off.pooled_cosine < 0.99
    assert off.failures(PRECISION_BOUNDS["bf16"])[0].startswith("pooled cosine")
    got[0, 1, 0] = float("nan")
    assert not fidelity(_outputs(got, lengths), _outputs(want, lengths), [], PRECISION_BOUNDS["bf16"]).finite


def test_head_scores_are_compared_by_error_and_by_order_beyond_the_tie():
    """A reranker's scores for two queries' pairs (groups): the error is taken against the largest |score|; an
    order swap counts only within a query and only where fp32 separates the two by more than the tie."""
    hidden = torch.ones(4, 2, 8)
    want = torch.tensor([[10.0], [5.0], [5.05], [-3.0]])  # query 0: pairs 0, 1; query 1: pairs 2, 3
    bound = PRECISION_BOUNDS["bf16"]  # tie: 0.01 x 10 = 0.1
    pairs = [dataclasses.replace(b, pairs=True) for b in _outputs(hidden, [2] * 4, rerank=want)]

    def measured(scores: list[float], groups: list[int]) -> Fidelity:
        got = [dataclasses.replace(b, pairs=True)
               for b in _outputs(hidden, [2] * 4, rerank=torch.tensor(scores)[:, None])]
        return fidelity(got, pairs, groups, bound)

    assert measured([10.0, 5.0, 5.05, -3.0], [0, 0, 1, 1]).rank_swaps == 0
    close = measured([10.0, 5.1, 4.95, -3.0], [0, 0, 1, 1])  # 1 and 2 swapped, but they are different queries'
    assert close.rank_swaps == 0 and close.score_error == pytest.approx(0.01, rel=1e-4)
    same_query = measured([10.0, 5.1, 4.95, -3.0], [0, 1, 1, 0])  # now one query's, 0.05 apart: within the tie
    assert same_query.rank_swaps == 0
    swapped = measured([4.0, 5.0, 5.05, -3.0], [0, 0, 1, 1])  # query 0's order reversed
    assert swapped.rank_swaps == 1 and swapped.score_error == pytest.approx(0.6, rel=1e-4)
    classify = _outputs(hidden, [2] * 4, classify=torch.tensor([[1.0, 0.0, -1.0]] * 4))  # labels, row by row
    flipped = _outputs(hidden, [2] * 4, classify=torch.tensor([[0.0, 1.0, -1.0]] * 4))
    assert fidelity(flipped, classify, [], bound).rank_swaps == 4


def test_timed_rounds_interleave_and_keep_every_round_in_order():
    calls: list[str] = []
    times = timed_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, budget_s=60)
    assert calls == ["a", "b", "b", "a", "a", "b"] and {name: len(s) for name, s in times.items()} == {"a": 3, "b": 3}
    fastest = fastest_times({"a": lambda: None}, rounds=3, budget_s=60)
    assert set(fastest) == {"a"} and fastest["a"] >= 0
    spent = timed_rounds({"a": lambda: None}, rounds=9, budget_s=-1, min_rounds=3)  # budget gone: the minimum
    assert len(spent["a"]) == 3


def _reduced_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inject the probe's timing: bf16 4x and fp16 2x fp32's speed, so the accuracy gate decides on any machine
    (however busy: no candidate's first calls are taken as too slow to time)."""
    import service.runner

    monkeypatch.setattr(service.runner, "PROBE_SLOW", float("inf"))
    monkeypatch.setattr(service.runner, "timed_rounds", lambda runs, **_: {
        name: [{"fp32": 0.04, "bf16": 0.01, "fp16": 0.02}[name]] * 3 for name in runs})


def test_precision_auto_measures_on_the_loaded_model_and_refuses_one_beyond_the_bound(
        overflowing_bundle: Path, monkeypatch: pytest.MonkeyPatch):
    _reduced_fast(monkeypatch)
    runner = _runner(overflowing_bundle, precision="auto")
    spec = runner.load()
    assert "bf16 refused: differs from fp32 beyond the bound on 15 rows of ids drawn across the vocabulary" \
        in spec.precision_reason, spec.precision_reason
    assert spec.precision != "bf16" and set(spec.precision_forward_ms) == {"fp32", "bf16", "fp16"}


@pytest.fixture(scope="module")
def text_offset_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text model that bf16 and fp16 break on text and not on random ids. BERT-sized table (30,522 rows),
    TINY otherwise, a LayerNorm after the embeddings (as BERT has); the rows of the 12 ids its tokenizer produces
    (tests/support/hf_helpers.py TINY_VOCAB) carry a shared offset of 100 in every dimension, as word embeddings
    share a large common mean vector (Mu and Viswanath, "All-but-the-Top", 2018), exaggerated on the rows text
    uses. In fp32 the LayerNorm takes the offset off and the rest of the row stays; in bf16 (8 bits of mantissa)
    or fp16 (11) the table's rows round to the offset's grid, 0.5-0.06 apart, and lose it. Random ids draw the
    other 30,510 rows."""
    from model.text import TextSettings, sha256_bytes
    from tests.support.hf_helpers import TINY_VOCAB, tiny_tokenizer_json

    config = dataclasses.replace(TINY, vocab_size=30522, embedding_norm=True)
    model = Encoder(config).init_weights(0)
    with torch.no_grad():
        model.tok_emb.weight[: len(TINY_VOCAB)] += 100.0
    data = tiny_tokenizer_json()
    path = tmp_path_factory.mktemp("bundles") / "text-offset"
    save_bundle(model, path, name="text-offset", version="1", source="seed:0, text rows +100",
                text=(data, TextSettings(tokenizer_sha256=sha256_bytes(data), max_tokens=64)))
    return path


def test_the_gate_refuses_a_precision_that_fails_on_text_while_passing_on_random_ids(
        text_offset_bundle: Path, monkeypatch: pytest.MonkeyPatch):
    """The probe's own random ids (what the gate ran on before) find bf16 within every bound; the tokenizer on the
    calibration texts does not, and precision=auto serves fp32, saying why. (Before the gate ran on text, this
    bundle was served in bf16.)"""
    from model.bundle import load_bundle
    from service.calibration import Calibration, bundle_outputs
    from service.runner import _probe_batch

    fp32, bf16 = load_bundle(text_offset_bundle), load_bundle(text_offset_bundle, dtype="bfloat16")
    ids, lengths = _probe_batch(fp32.manifest.config)
    random_ids = Calibration([row[:n].numpy() for row, n in zip(ids, lengths, strict=True)])
    passed = fidelity(bundle_outputs(bf16, random_ids), bundle_outputs(fp32, random_ids), [], PRECISION_BOUNDS["bf16"])
    assert passed.within(PRECISION_BOUNDS["bf16"]), passed
    _reduced_fast(monkeypatch)
    spec = _runner(text_offset_bundle, precision="auto").load()
    assert spec.precision == "fp32" and spec.precision_fidelity == {}, spec.precision_reason
    assert "bf16 refused: differs from fp32 beyond the bound on 62 texts through the tokenizer (3-64 tokens)" \
        in spec.precision_reason, spec.precision_reason
    assert "pooled cosine" in spec.precision_reason.split("bf16 refused")[1]


def test_a_reranker_is_checked_on_its_scores_and_their_order(bert_reranker: tuple[Path, Path, object],
                                                            monkeypatch: pytest.MonkeyPatch):
    """A cross-encoder's bf16 is judged on query-passage pairs too: with bounds it meets (loosened here: what a
    tiny random reranker measures is not the point), it is served and its score error and order are reported."""
    _reduced_fast(monkeypatch)
    monkeypatch.setitem(PRECISION_BOUNDS, "bf16", Bound(min_cosine=0.9, max_hidden_error=0.5, min_token_cosine=0.9,
                                                        max_score_error=0.5, rank_tie=0.5))
    spec = _runner(bert_reranker[0], precision="auto").load()
    assert spec.precision == "bf16", spec.precision_reason
    assert "62 texts through the tokenizer (3-32 tokens) and 96 query-passage pairs" in spec.precision_reason
    assert {"score_error", "rank_swaps"} <= spec.precision_fidelity.keys(), spec.precision_fidelity
    assert 0 < spec.precision_fidelity["score_error"] < 0.5 and spec.precision_fidelity["rank_swaps"] == 0


def test_a_measured_reduced_precision_keeps_the_fp32_module_for_retries(fault_bundle: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """precision=auto choosing bf16 with nonfinite_policy=retry (the defaults): the fp32 bundle loaded for the
    measurement serves the re-runs of non-finite rows (a start-up failed here once: the measurement handed
    back the module where the bundle was wanted). The timing is injected so that bf16 wins on any machine."""
    _reduced_fast(monkeypatch)
    runner = _runner(fault_bundle, precision="auto", nonfinite_policy="retry")
    spec = runner.load()
    assert spec.precision == "bf16" and spec.precision_reason.startswith("measured"), spec.precision_reason
    # What it served was checked on ids across the vocabulary, every measure within bf16's bound, reported.
    assert "15 rows of ids drawn across the vocabulary (1-64 tokens)" in spec.precision_reason
    assert spec.precision_fidelity.keys() == {"finite", "pooled_cosine", "token_cosine", "hidden_error"}
    assert Fidelity(**{k: v for k, v in spec.precision_fidelity.items() if k != "finite"}).within(
        PRECISION_BOUNDS["bf16"])
    nan, clean = runner.execute([Job(np.array([5, faults.NAN_ROW, 7]), None), Job(np.array([5, 6, 7]), None)])[0]
    assert isinstance(nan, Output) and nan.fp32_rerun and nan.hidden is not None and np.isfinite(nan.hidden).all()
    assert isinstance(clean, Output) and not clean.fp32_rerun


def test_the_probe_is_timed_at_one_workers_width_and_its_rounds_ratios_decide(tiny_bundle: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """precision=auto with the default split of 2 workers on 2 threads: the precisions are timed on 1 thread,
    a worker's share, and the width is back to every thread for what load() runs next. The timings are
    injected (each run still runs, so the width it ran at is seen): fp32 had the one quiet call, bf16 is
    2x fp32 round by round; the rounds' ratios choose bf16 and the reason says what was measured."""
    import service.runner

    widths: list[int] = []

    def rounds(runs: dict[str, Callable[[], object]], **_: object) -> dict[str, list[float]]:
        for run in runs.values():
            run()
            widths.append(torch.get_num_threads())
        times = {"fp32": [0.04, 0.40, 0.12, 0.80], "bf16": [0.06, 0.20, 0.06, 0.40]}
        return {name: times.get(name, [1.0] * 4) for name in runs}

    monkeypatch.setattr(service.runner, "timed_rounds", rounds)
    monkeypatch.setattr(service.runner, "PROBE_SLOW", float("inf"))  # however busy the machine
    runner = Runner(test_config(tiny_bundle, precision="auto", torch_threads=2), str(tiny_bundle),
                    Metrics(CollectorRegistry()), workers=2)
    spec = runner.load()
    assert widths and set(widths) == {1} and torch.get_num_threads() == 2
    assert spec.precision == "bf16", spec.precision_reason
    assert spec.precision_reason.startswith(
        "measured at warm-up on 4x64 tokens at 1 of 2 thread(s) (one of 2 workers' share), 4 interleaved rounds "
        "(median forward: fp32 260.0 ms, bf16 130.0 ms"), spec.precision_reason
    assert "bf16 2.00x fp32's speed (the median of 4 rounds' ratios, 0.67-2.00x)" in spec.precision_reason
    assert spec.precision_forward_ms["fp32"] == 260.0 and spec.precision_forward_ms["bf16"] == 130.0


def test_an_injected_bound_nothing_can_meet_leaves_fp32(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch):
    _reduced_fast(monkeypatch)
    for name in ("bf16", "fp16"):
        monkeypatch.setitem(PRECISION_BOUNDS, name, Bound(min_cosine=1.0, max_hidden_error=0.0, min_token_cosine=1.0,
                                                          max_score_error=0.0, rank_tie=0.0))
    spec = _runner(tiny_bundle, precision="auto").load()
    assert spec.precision == "fp32" and spec.precision_reason.startswith("measured")
    assert "bf16 refused" in spec.precision_reason and "fp16 refused" in spec.precision_reason


def test_a_configured_precision_wins_and_is_not_measured(tiny_bundle: Path):
    spec = _runner(tiny_bundle, precision="bf16").load()
    assert (spec.precision, spec.precision_reason, spec.precision_forward_ms) == ("bf16", "configured", {})
    assert spec.precision_fidelity == {}
    off = _runner(tiny_bundle, precision="auto", warmup=False).load()
    assert off.precision == "fp32" and off.precision_reason.startswith("not measured")


def test_the_budget_is_the_smallest_within_the_gain_of_the_best():
    assert choose_batch_tokens({256: 100.0, 512: 180.0, 1024: 190.0, 2048: 195.0}) == 512  # flat after 512
    assert choose_batch_tokens({256: 100.0, 512: 200.0, 1024: 400.0}) == 1024  # still growing: the largest
    assert choose_batch_tokens({256: 100.0, 512: 50.0, 1024: 300.0, 2048: 310.0}) == 1024  # a slowed point
    assert choose_batch_tokens({256: 100.0, 512: 90.0}) == 256


def test_the_measured_shapes_reach_each_budget_within_the_batch_size_and_the_model():
    assert batch_shapes(512, 64, [256, 1024, 16384, 65536]) == [(2, 128), (8, 128), (64, 256), (64, 512)]
    assert batch_shapes(64, 64, [128, 256, 8192]) == [(2, 64), (4, 64), (64, 64)]  # tiny: the longest rows


def test_a_configured_budget_wins_and_one_sequence_always_fits():
    spec = ModelSpec("m", "1", "x", 32, 4, 2, 100, 512, "sinusoidal", "fp32", "cpu")
    config = ServiceConfig(max_batch_tokens=4096)
    assert batch_budget(config, {256: 1.0, 512: 1.0}, 128, 1).max_batch_tokens == 4096
    measured = batch_budget(ServiceConfig(), {128: 100.0, 256: 101.0}, 128, 1)
    assert measured.max_batch_tokens == 128 and measured.reason.startswith("measured")
    assert batch_limits(ServiceConfig(), spec, measured).max_batch_tokens == 512  # the model's max_length


def test_the_choices_cross_to_edge_processes_intact():
    spec = ModelSpec("m", "1", "x", 32, 4, 2, 100, 64, "sinusoidal", "bf16", "cpu", precision_reason="measured: ...",
                     precision_forward_ms={"fp32": 2.0, "bf16": 1.0},
                     precision_fidelity={"pooled_cosine": 0.9998, "rank_swaps": 0.0}, max_batch_tokens=512,
                     batch_reason="measured",
                     batch_curve={256: 10.0, 512: 11.0}, quantization_ranges=((-0.5,), (0.5,)),
                     model_workers=2, workers_reason="measured", compared_workers=1, compared_curve={256: 9.0})
    other = dataclasses.replace(spec, name="n", precision="fp32")
    body = frames.hello([frames.Served(spec, ("alias",), {"max_sequences_per_call": 8}), frames.Served(other)], "m", 2)
    got, default, workers, _ = frames.read_hello(memoryview(body)[frames.HEADER.size:])
    assert [g.spec for g in got] == [spec, other] and default == "m" and workers == 2
    assert got[0].aliases == ("alias",) and got[0].settings == {"max_sequences_per_call": 8} and not got[1].aliases


async def test_precision_and_budget_chosen_at_start_are_reported_by_model_info_and_metrics(start_server):
    s = await start_server(precision="auto", max_batch_tokens=0)
    info = await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.precision_reason.startswith("measured at warm-up") and info.precision in info.precision_reason
    assert {"fp32", "bf16"} <= set(info.precision_forward_ms) and info.precision_forward_ms["fp32"] > 0
    budget = info.batch_budget
    assert budget.reason.startswith("measured at warm-up") and len(budget.tokens_per_second) >= 2
    assert budget.max_batch_tokens in set(budget.tokens_per_second) | {info.max_length}
    assert s.sample("attention_model_info", {"name": "tiny", "version": "1", "device": "cpu",
                                             "precision": info.precision, "precision_source": "measured"}) == 1
    assert s.sample("attention_batch_tokens_limit", {"source": "measured"}) == budget.max_batch_tokens
    assert s.sample("attention_warmup_forward_seconds", {"precision": "fp32"}) > 0
    response = await s.stub.Encode(ids_request([1, 2, 3]), timeout=10)
    assert response.metadata.precision == info.precision  # what it said is what it serves


async def test_configured_choices_are_reported_as_configured(served):
    info = await served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.precision, info.precision_reason, dict(info.precision_forward_ms)) == ("fp32", "configured", {})
    assert (info.batch_budget.max_batch_tokens, info.batch_budget.reason) == (2048, "configured")


async def test_a_serving_engine_shortens_the_gil_switch_interval(start_server):
    """The model threads must not wait 5 ms (CPython's default) for the GIL behind the event loop."""
    import sys

    from service.engine import SWITCH_INTERVAL_S

    sys.setswitchinterval(0.005)
    try:
        await start_server()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S) and SWITCH_INTERVAL_S < 0.005
    finally:
        sys.setswitchinterval(0.005)


async def test_the_served_precisions_fidelity_is_reported_by_model_info_and_teis_info(
        start_server, monkeypatch: pytest.MonkeyPatch):
    """What the accuracy gate measured for the precision served is what GetModelInfo and TEI's /info report
    (the timing injected so that bf16 is served on any machine; fp32 asked for: nothing measured, both empty)."""
    import httpx

    _reduced_fast(monkeypatch)
    s = await start_server(precision="auto", http_port=0)
    info = await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.precision == "bf16", info.precision_reason
    assert {"pooled_cosine", "token_cosine", "hidden_error"} <= info.precision_fidelity.keys()
    assert 0.9 < info.precision_fidelity["pooled_cosine"] <= 1.0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.http_port}") as http:
        assert (await http.get("/info")).json()["precision_fidelity"] == dict(info.precision_fidelity)
    fp32 = await start_server(precision="fp32", http_port=0)
    assert not (await fp32.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).precision_fidelity
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{fp32.server.http_port}") as http:
        assert (await http.get("/info")).json()["precision_fidelity"] == {}
