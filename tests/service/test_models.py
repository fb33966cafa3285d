"""Several models in one engine (service/engine.py): each served by name on the one set of model threads and
the one scheduler, answering as it does alone (fp32); a model that fails at start-up reported by name; models
loaded and unloaded at run time under load, nothing accepted lost, memory given back; the memory budget.

The engine is driven directly (its lanes are what the front doors admit into), so these tests hold the model
half of issue 41 whatever the doors do.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from model.bundle import load_bundle, save_bundle
from model.config import TINY, EncoderConfig
from model.encoder import Encoder
from service.batching import Request
from service.config import ModelEntry, ServiceConfig
from service.engine import Engine, LoadedModel
from service.errors import FailedPrecondition, InvalidInput, NotFound, ServiceError, ShuttingDown
from service.fault_hooks import FaultHooks
from service.jobs import POOL_MEAN, Job
from service.memory import MIB, estimate_bytes, rss_bytes
from service.metrics import Metrics
from service.process import freeze_heap
from service.runner import Runner
from tests.support.helpers import test_config

SMALL = EncoderConfig(d_model=16, n_heads=2, n_layers=1, d_ff=32, vocab_size=50, max_length=32)
# Big enough that its weights (~96 MiB in fp32) stand out of a process's RSS noise, and quick to build.
BIG = EncoderConfig(d_model=256, n_heads=4, n_layers=1, d_ff=512, vocab_size=90_000, max_length=32)


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second model, not the tiny one: other sizes, other seed, its own name."""
    path = tmp_path_factory.mktemp("bundles") / "small"
    save_bundle(Encoder(SMALL).init_weights(1), path, name="small", version="2", source="seed:1")
    return path


@pytest.fixture(scope="session")
def big_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bundles") / "big"
    save_bundle(Encoder(BIG).init_weights(2), path, name="big", version="1", source="seed:2")
    return path


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[Engine]]]:
    """`await make(config, load=True)` -> a started engine (loaded unless told); drained after the test."""
    made: list[Engine] = []

    async def make(config: ServiceConfig, load: bool = True) -> Engine:
        engine = Engine(config, Metrics(CollectorRegistry()), FaultHooks.from_config(config))
        engine.start()
        made.append(engine)
        if load:
            await engine.load()
        return engine

    yield make
    for engine in made:
        engine.close()
        await engine.drain(2.0, 0.25)


def two_models(tiny: Path, small: Path, **overrides: Any) -> ServiceConfig:
    models = (ModelEntry("embedder", str(tiny), aliases=("text-embedding",)),
              ModelEntry("small", str(small), settings=(("max_batch_tokens", 512), ("max_sequences_per_call", 8))))
    return test_config(tiny, model="", models=models, **overrides)


def ids(n: int, length: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab - 5, rng.integers(1, length + 1)).astype(np.int64) for _ in range(n)]


async def encode(model: LoadedModel, jobs: list[Job], seconds: float = 30) -> list[Any]:
    items = model.admission.submit([Request(job, job.length, job.key) for job in jobs], time.monotonic() + seconds)
    try:
        return [done.output for done in await asyncio.gather(*(item.future for item in items))]
    finally:
        model.admission.cancel(items)


def reference(bundle: Path, sequence: np.ndarray) -> np.ndarray:
    """The bundle's own module, fp32, on one sequence: the truth."""
    module = load_bundle(bundle).module
    with torch.inference_mode():
        hidden, _ = module(torch.from_numpy(sequence)[None], None, torch.tensor([len(sequence)]), False, [])
    return np.asarray(hidden[0].numpy())


async def test_two_models_answer_each_as_alone_on_one_set_of_threads(engines, tiny_bundle, small_bundle):
    engine = await engines(two_models(tiny_bundle, small_bundle))
    assert list(engine.models) == ["embedder", "small"] and engine.default == "embedder"
    embedder, small = engine.models["embedder"], engine.models["small"]
    assert (embedder.spec.name, small.spec.name) == ("embedder", "small")  # the served names
    assert (embedder.spec.d_model, small.spec.d_model) == (32, 16)
    assert embedder.aliases == ("text-embedding",) and engine.resolve("text-embedding") is embedder
    assert engine.resolve("") is embedder and engine.resolve("small") is small
    with pytest.raises(NotFound, match="models: embedder, small"):
        engine.resolve("gpt-4")
    # Each model's own settings, over the service's.
    assert small.admission.limits.max_batch_tokens == 512 and embedder.admission.limits.max_batch_tokens == 2048
    assert small.config.max_sequences_per_call == 8 and embedder.config.max_sequences_per_call == 64
    # One scheduler and one set of model threads, not one per model.
    assert embedder.admission.scheduler is small.admission.scheduler is engine.scheduler
    runners = [t for t in threading.enumerate() if t.name.startswith("model-runner")]
    assert len(runners) == engine.workers

    a_seqs, b_seqs = ids(12, 40, TINY.vocab_size, seed=1), ids(12, 30, SMALL.vocab_size, seed=2)
    a_out, b_out = await asyncio.gather(  # both models at once, one call each per sequence
        asyncio.gather(*(encode(embedder, [Job(s, None)]) for s in a_seqs)),
        asyncio.gather(*(encode(small, [Job(s, None)]) for s in b_seqs)))
    for bundle, seqs, outs in ((tiny_bundle, a_seqs, a_out), (small_bundle, b_seqs, b_out)):
        for seq, (out,) in zip(seqs, outs, strict=True):
            np.testing.assert_allclose(out.hidden, reference(bundle, seq), atol=1e-5, rtol=0)


async def test_a_cross_encoder_beside_an_embedder_scores_as_it_does_alone(engines, tiny_bundle, bert_reranker):
    bundle = bert_reranker[0]
    config = test_config(tiny_bundle, model="", models=(ModelEntry("embed", str(tiny_bundle)),
                                                        ModelEntry("rerank", str(bundle))))
    engine = await engines(config)
    rerank = engine.models["rerank"]
    assert "rerank" in rerank.spec.tasks
    types = np.array([0, 0, 0, 1, 1, 1], np.int64)
    jobs = [Job(np.array([2, 5 + i, 7, 3, 9, 11], np.int64), None, return_hidden=False, head="rerank",
                token_types=types) for i in range(4)]
    scores = [out.scores for out in await encode(rerank, jobs)]
    alone = Runner(config.for_model(config.models[1]), str(bundle), Metrics(CollectorRegistry()))
    alone.load()
    want = [out.scores for out in alone.execute(jobs)[0]]
    np.testing.assert_allclose(np.array(scores), np.array(want), atol=1e-6, rtol=0)
    pooled = await encode(engine.models["embed"], [Job(np.array([1, 2, 3], np.int64), None, pooling=POOL_MEAN)])
    assert pooled[0].pooled.shape == (32,)


async def test_one_bare_model_is_served_as_before_named_by_its_manifest(engines, tiny_bundle):
    engine = await engines(test_config(tiny_bundle))
    assert list(engine.models) == ["tiny"] and engine.default == "tiny"
    assert engine.batcher is engine.models["tiny"].admission and engine.spec is engine.models["tiny"].spec
    assert engine.spec.name == "tiny" and engine.spec.version == "1"
    registry = engine.metrics.registry
    (out,) = await encode(engine.models["tiny"], [Job(np.array([1, 2, 3], np.int64), None)])
    assert out.hidden.shape == (3, 32)
    assert registry.get_sample_value("attention_batch_size_count", {"model": "tiny"}) == 1


async def test_a_model_that_fails_at_start_up_is_reported_by_name_and_the_others_serve(
        engines, tiny_bundle, small_bundle, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    config = test_config(tiny_bundle, model="", models=(
        ModelEntry("embedder", str(tiny_bundle)), ModelEntry("broken", str(broken)),
        ModelEntry("small", str(small_bundle))))
    engine = await engines(config)
    assert list(engine.models) == ["embedder", "small"]
    assert list(engine.failed) == ["broken"] and "manifest" in engine.failed["broken"]
    (out,) = await encode(engine.models["small"], [Job(np.array([1, 2], np.int64), None)])
    assert out.hidden.shape == (2, 16)
    # The default failing fails the start-up: calls that name no model would have nowhere to go.
    config = test_config(tiny_bundle, model="", models=(ModelEntry("broken", str(broken)),
                                                        ModelEntry("embedder", str(tiny_bundle))))
    engine = await engines(config, load=False)
    with pytest.raises(Exception, match="manifest"):
        await engine.load()


async def test_two_bare_models_with_one_manifest_name_refuse_the_second_by_name(engines, tiny_bundle, tmp_path):
    copy = tmp_path / "copy"
    save_bundle(Encoder(TINY).init_weights(5), copy, name="tiny", version="9", source="seed:5")
    config = test_config(tiny_bundle, model="", models=(ModelEntry("", str(tiny_bundle)), ModelEntry("", str(copy))))
    engine = await engines(config)
    assert list(engine.models) == ["tiny"] and engine.models["tiny"].spec.version == "1"
    assert "'tiny' is taken" in engine.failed[str(copy)]


async def test_models_load_and_unload_at_run_time_under_load_losing_no_accepted_call(
        engines, tiny_bundle, small_bundle):
    engine = await engines(test_config(tiny_bundle, model_control="explicit", model_workers=2, torch_threads=2))
    tiny = engine.models["tiny"]
    stop = asyncio.Event()
    answered: dict[str, int] = {"tiny": 0, "small": 0}
    refused: list[str] = []
    seqs = {"tiny": ids(8, 30, TINY.vocab_size, seed=3), "small": ids(8, 20, SMALL.vocab_size, seed=4)}
    want = {"tiny": [reference(tiny_bundle, s) for s in seqs["tiny"]],
            "small": [reference(small_bundle, s) for s in seqs["small"]]}

    async def caller(name: str, n: int) -> None:
        for i in range(400):  # bounded in count; ends when told
            if stop.is_set():
                return
            try:
                model = engine.resolve(name)
            except NotFound:
                refused.append("not_found")
                await asyncio.sleep(0.005)
                continue
            k = (i + n) % len(seqs[name])
            try:
                (out,) = await encode(model, [Job(seqs[name][k], None)])
            except ShuttingDown:
                refused.append("shutting_down")
                continue
            np.testing.assert_allclose(out.hidden, want[name][k], atol=1e-5, rtol=0)  # never a wrong answer
            answered[name] += 1

    on_tiny = [asyncio.create_task(caller("tiny", n)) for n in range(3)]
    # Loaded while the tiny model serves: its precision, and its batch budget measured at its own warm-up
    # (max_batch_tokens 0), on the model threads between tiny's batches.
    small = await engine.load_model("small", str(small_bundle), {"max_batch_tokens": 0, "precision": "fp32",
                                                                  "aliases": ["s"]})
    assert engine.models["small"] is small and engine.resolve("s") is small
    assert small.spec.batch_reason.startswith("measured") and small.spec.model_workers == engine.workers
    assert small.admission.limits.max_batch_tokens == small.spec.max_batch_tokens >= SMALL.max_length
    before = answered["tiny"]
    on_small = [asyncio.create_task(caller("small", n)) for n in range(3)]
    while answered["small"] < 20:
        await asyncio.sleep(0.01)
    assert answered["tiny"] > before or all(not t.done() for t in on_tiny)
    await engine.unload_model("small", grace=10)
    assert "small" not in engine.models and small.runner is None
    with pytest.raises(NotFound):
        engine.resolve("small")
    stop.set()
    await asyncio.gather(*on_tiny, *on_small)  # a wrong answer or an unexpected error would raise here
    assert answered["tiny"] > 0 and answered["small"] >= 20
    assert set(refused) <= {"not_found", "shutting_down"}
    registry = engine.metrics.registry
    assert registry.get_sample_value("attention_queue_depth", {"model": "small"}) is None  # its gauges went
    assert registry.get_sample_value("attention_batch_size_count", {"model": "small"}) > 0  # its counts stay
    assert tiny.ready and (await encode(tiny, [Job(seqs["tiny"][0], None)]))[0].hidden.shape[1] == 32
    # Loaded again under its name: served afresh.
    again = await engine.load_model("small", str(small_bundle))
    (out,) = await encode(again, [Job(seqs["small"][0], None)])
    np.testing.assert_allclose(out.hidden, want["small"][0], atol=1e-5, rtol=0)


async def test_unloading_answers_accepted_calls_then_refuses(engines, tiny_bundle, small_bundle):
    engine = await engines(test_config(tiny_bundle, model_control="explicit"))
    small = await engine.load_model("small", str(small_bundle))
    gate = threading.Event()
    entered = threading.Event()

    def held() -> None:
        entered.set()
        gate.wait(10)

    hold = asyncio.wrap_future(engine.scheduler.run_on(0, held))  # the model thread, busy
    await asyncio.to_thread(entered.wait, 10)
    accepted = [asyncio.create_task(encode(small, [Job(np.array([1, 2, i], np.int64), None)])) for i in range(3, 8)]
    await asyncio.sleep(0)
    unloading = asyncio.create_task(engine.unload_model("small", grace=10))
    await asyncio.sleep(0.05)
    assert not small.ready
    with pytest.raises(ShuttingDown, match="'small' is being unloaded"):
        small.admission.submit([Request(Job(np.array([1], np.int64), None), 1, ())], time.monotonic() + 5)
    gate.set()
    await hold
    outs = await asyncio.gather(*accepted)
    await unloading
    assert [o[0].hidden.shape for o in outs] == [(3, 16)] * 5  # every accepted call answered
    with pytest.raises(NotFound, match="models: tiny"):
        engine.resolve("small")


async def test_run_time_load_and_unload_are_refused_unless_explicit_and_say_why(engines, tiny_bundle, small_bundle):
    engine = await engines(test_config(tiny_bundle))
    with pytest.raises(FailedPrecondition, match="--model-control explicit"):
        await engine.load_model("small", str(small_bundle))
    with pytest.raises(FailedPrecondition, match="--model-control explicit"):
        await engine.unload_model("tiny", 1)
    engine = await engines(test_config(tiny_bundle, model_control="explicit"))
    with pytest.raises(FailedPrecondition, match="'tiny' is the default model"):
        await engine.unload_model("tiny", 1)
    with pytest.raises(NotFound, match="models: tiny"):
        await engine.unload_model("nope", 1)
    with pytest.raises(FailedPrecondition, match="'tiny' is taken"):
        await engine.load_model("tiny", str(small_bundle))
    with pytest.raises(InvalidInput, match="max_batch_size.*must be an int"):
        await engine.load_model("small", str(small_bundle), {"max_batch_size": "many"})
    with pytest.raises(InvalidInput, match="unknown setting 'colour'"):
        await engine.load_model("small", str(small_bundle), {"colour": "red"})
    with pytest.raises(InvalidInput, match="neither a model bundle"):
        await engine.load_model("small", str(small_bundle / "nope"))
    assert list(engine.models) == ["tiny"]
    small = await engine.load_model("small", str(small_bundle))  # the refusals left nothing behind
    assert small.ready


async def test_a_model_over_the_memory_budget_is_refused_saying_so(engines, tiny_bundle, big_bundle):
    estimate = estimate_bytes(big_bundle, test_config(big_bundle), cuda=False)
    assert 88 * MIB < estimate < 92 * MIB  # its fp32 weights: 90 000 x 256 x 4 bytes, and one small layer
    config = test_config(tiny_bundle, model_control="explicit", memory_budget_mb=50)
    engine = await engines(config)
    with pytest.raises(FailedPrecondition, match=r"'big' does not fit the memory budget: its weights need about \d\d "
                                                 r"MiB .*of 50 MiB are taken .*tiny 0"):
        await engine.load_model("big", str(big_bundle))
    assert list(engine.models) == ["tiny"] and engine.memory_reserved == engine.models["tiny"].memory_bytes
    # At start-up: reported by name, the others served.
    config = test_config(tiny_bundle, model="", memory_budget_mb=50, models=(
        ModelEntry("tiny", str(tiny_bundle)), ModelEntry("big", str(big_bundle))))
    engine = await engines(config)
    assert list(engine.models) == ["tiny"] and "does not fit the memory budget" in engine.failed["big"]


@pytest.mark.parametrize("frozen", [False, True], ids=["heap", "frozen-heap"])
async def test_unloading_a_model_gives_its_memory_back(engines, tiny_bundle, big_bundle, frozen):
    # frozen: loaded before the heap was frozen, as a served process freezes it once SERVING (service/process.py
    # freeze_heap; in the permanent generation, which collections skip, unless release() thaws it).
    engine = await engines(test_config(tiny_bundle, model_control="explicit", warmup=False))
    await asyncio.sleep(0)
    assert gc.get_freeze_count() == 0
    before = rss_bytes()
    big = await engine.load_model("big", str(big_bundle))
    estimate = big.memory_bytes
    (out,) = await encode(big, [Job(np.array([1, 2, 3], np.int64), None)])
    assert out.hidden.shape == (3, 256)
    del out
    cycle: list[Any] = [big.runner]  # a reference cycle through the runner, as a traceback or a closure makes:
    cycle.append(cycle)  # once unreachable only a garbage collection frees it, and none scans the frozen heap
    try:
        if frozen:
            assert freeze_heap() > 0
        del cycle
        loaded = rss_bytes()
        await engine.unload_model("big", grace=5)
        after = rss_bytes()  # `big` still held, as a caller or a door's registry may: its runner is let go of
        assert (gc.get_freeze_count() > 0) == frozen  # what survived is frozen again
    finally:
        gc.unfreeze()  # this test process's heap as it was
    grew, kept = loaded - before, after - before
    print(f"RSS before {before / MIB:.0f} MiB, loaded {loaded / MIB:.0f} MiB (+{grew / MIB:.0f}), "
          f"unloaded {after / MIB:.0f} MiB (+{kept / MIB:.0f})")
    assert grew > 0.8 * estimate  # the big model's weights were resident
    assert kept < grew / 4, f"the unload gave back {(loaded - after) / MIB:.0f} of {grew / MIB:.0f} MiB"


def test_every_error_the_engine_raises_is_a_service_error():
    # The doors map ServiceErrors to statuses; anything else would be INTERNAL.
    assert all(issubclass(e, ServiceError) for e in (FailedPrecondition, InvalidInput, NotFound, ShuttingDown))
