"""The fault-injecting model: every sentinel does what model/faults.py documents, clean rows are untouched."""

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model import fault_ops, faults
from model.bundle import load_bundle, save_bundle
from model.encoder import Encoder
from tests.support.model_helpers import batch

CFG = faults.FAULT_CONFIG


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("faults") / "fault"
    manifest = faults.build_fault_bundle(directory, seed=0)
    assert manifest.name == "fault-model" and manifest.config == CFG
    return directory


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wrapped encoder alone, same seed: what clean rows must equal."""
    directory = tmp_path_factory.mktemp("faults") / "plain"
    save_bundle(Encoder(CFG).init_weights(0), directory, name="plain", version="1", source="test")
    return directory


@pytest.fixture(scope="module")
def models(bundle_dir: Path, plain_dir: Path) -> dict[str, torch.jit.ScriptModule]:
    return {f"{kind}-{dtype}": load_bundle(d, dtype=dtype).module
            for kind, d in (("fault", bundle_dir), ("plain", plain_dir)) for dtype in ("float32", "bfloat16")}


@pytest.fixture(autouse=True)
def clean_state() -> Iterator[None]:
    faults.reset()
    yield
    faults.HANG_RELEASE.set()  # never leave a model thread blocked
    faults.reset()


def run(module: torch.jit.ScriptModule, ids: torch.Tensor, lengths: torch.Tensor, layers: list[int] | None = None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.inference_mode():
        return module(ids, None, lengths, False, layers or [])


def _with(sentinel: int, row: int = 1, position: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids, lengths = batch(CFG, [10, 6, 3], seed=11)
    ids[row, position] = sentinel
    return ids, lengths


def test_sentinels_are_distinct_top_ids() -> None:
    assert len(set(faults.SENTINELS)) == len(faults.SENTINELS)
    assert all(CFG.vocab_size - 10 <= s < CFG.vocab_size for s in faults.SENTINELS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_batch_equals_wrapped_encoder(models: dict, dtype: str) -> None:
    ids, lengths = batch(CFG, [10, 6, 3], seed=11)
    for layers in ([], [0, 1]):
        got, got_w = run(models[f"fault-{dtype}"], ids, lengths, layers)
        want, want_w = run(models[f"plain-{dtype}"], ids, lengths, layers)
        assert torch.equal(got, want)
        assert (got_w is None and want_w is None) or torch.equal(got_w, want_w)


def test_nan_row_only_in_reduced_precision(models: dict) -> None:
    ids, lengths = _with(faults.NAN_ROW)
    got, got_w = run(models["fault-float32"], ids, lengths, [1])
    want, want_w = run(models["plain-float32"], ids, lengths, [1])
    assert torch.equal(got, want) and torch.equal(got_w, want_w), "fp32 must recover the row"
    got, got_w = run(models["fault-bfloat16"], ids, lengths, [1])
    want, _ = run(models["plain-bfloat16"], ids, lengths, [1])
    assert got_w is not None
    assert torch.isnan(got[1]).all() and torch.isnan(got_w[1]).all()
    for clean in (0, 2):
        assert torch.equal(got[clean], want[clean]) and torch.isfinite(got_w[clean]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_always_in_every_dtype(models: dict, dtype: str) -> None:
    ids, lengths = _with(faults.NAN_ALWAYS, row=2)
    got, _ = run(models[f"fault-{dtype}"], ids, lengths)
    want, _ = run(models[f"plain-{dtype}"], ids, lengths)
    assert torch.isnan(got[2]).all()
    assert torch.equal(got[:2], want[:2])


def test_sentinels_in_padding_or_embeddings_do_nothing(models: dict) -> None:
    ids, lengths = _with(faults.NAN_ALWAYS, row=2, position=5)  # row 2 has length 3
    ids[1, 7] = faults.RAISE
    got, _ = run(models["fault-float32"], ids, lengths)
    assert torch.equal(got, run(models["plain-float32"], ids, lengths)[0])
    embeddings = torch.randn(1, 4, CFG.d_model)
    with torch.inference_mode():
        hidden, _ = models["fault-float32"](None, embeddings, torch.tensor([4]), False, [])
        assert torch.equal(hidden, models["plain-float32"](None, embeddings, torch.tensor([4]), False, [])[0])


def test_raise_is_a_runtime_error_from_torchscript(models: dict) -> None:
    ids, lengths = _with(faults.RAISE)
    with pytest.raises(RuntimeError, match=r"(?s)TorchScript interpreter.*fault-model: RAISE sentinel") as info:
        run(models["fault-bfloat16"], ids, lengths)
    assert not isinstance(info.value, torch.OutOfMemoryError)  # the type is lost inside TorchScript


def test_oom_always_and_oom_if_batch_gt_1(models: dict) -> None:
    oom = r"(?s)TorchScript interpreter.*CUDA out of memory\. Tried to allocate"
    ids, lengths = _with(faults.OOM, row=0)
    for rows in (slice(0, 3), slice(0, 1)):
        with pytest.raises(RuntimeError, match=oom):
            run(models["fault-float32"], ids[rows], lengths[rows])
    ids, lengths = _with(faults.OOM_IF_BATCH_GT_1, row=1)
    with pytest.raises(RuntimeError, match=oom):
        run(models["fault-float32"], ids, lengths)
    # Split-and-retry: every row alone succeeds and gives its row of the clean batch.
    want, _ = run(models["plain-float32"], ids, lengths)
    for b in range(3):
        n = int(lengths[b])
        alone, _ = run(models["fault-float32"], ids[b:b + 1, :n], lengths[b:b + 1])
        torch.testing.assert_close(alone[0], want[b, :n], atol=1e-5, rtol=0)


def test_sleep_per_occurrence(models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fault_ops.time, "sleep", slept.append)
    ids, lengths = _with(faults.SLEEP, row=0)
    ids[2, 1] = faults.SLEEP
    ids[2, 6] = faults.SLEEP  # padding: does not count
    got, _ = run(models["fault-float32"], ids, lengths)
    assert slept == [0.4]
    assert torch.equal(got, run(models["plain-float32"], ids, lengths)[0])
    many = torch.full((3, 64), faults.SLEEP)
    run(models["fault-float32"], many, torch.tensor([64, 64, 64]))
    assert slept[-1] == faults.MAX_SLEEP_MS / 1000  # 192 x 200 ms, capped at 30 s


def test_sleep_ms_is_a_build_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    faults.build_fault_bundle(tmp_path / "fast", sleep_ms=25)
    slept: list[float] = []
    monkeypatch.setattr(fault_ops.time, "sleep", slept.append)
    ids, lengths = _with(faults.SLEEP)
    run(load_bundle(tmp_path / "fast").module, ids, lengths)
    assert slept == [0.025]


def test_hang_blocks_until_released(models: dict) -> None:
    ids, lengths = _with(faults.HANG)
    result: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: result.append(run(models["fault-float32"], ids, lengths)[0]))
    worker.start()
    assert faults.HANG_ENTERED.wait(timeout=30)
    assert worker.is_alive() and result == []
    faults.HANG_RELEASE.set()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert torch.equal(result[0], run(models["plain-float32"], ids, lengths)[0])


def test_hang_gives_up_at_the_cap(models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fault_ops, "HANG_TIMEOUT_S", 0.01)
    ids, lengths = _with(faults.HANG)
    got, _ = run(models["fault-float32"], ids, lengths)  # returns, unreleased
    assert faults.HANG_ENTERED.is_set() and not faults.HANG_RELEASE.is_set()
    assert torch.isfinite(got).all()


def test_leak_grows_a_global_by_one_mib_per_call(models: dict) -> None:
    ids, lengths = _with(faults.LEAK)
    ids[0, 0] = faults.LEAK  # two rows, still one leak per call
    for expected in (1, 2, 3):
        run(models["fault-bfloat16"], ids, lengths)
        assert len(faults.LEAKED) == expected
    run(models["fault-bfloat16"], *batch(CFG, [4], seed=1))
    assert len(faults.LEAKED) == 3 and all(len(b) == faults.LEAK_BYTES for b in faults.LEAKED)


def test_fault_bundle_loads_in_a_fresh_process(bundle_dir: Path) -> None:
    """torch.jit.load alone fails (the ops are not registered); load_bundle imports model.faults itself."""
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "try:\n"
        "    torch.jit.load(str(Path(sys.argv[1]) / 'model.pt'))\n"
        "except RuntimeError as e:\n"
        "    print('attention_faults' in str(e))\n"
        "from model.bundle import load_bundle\n"
        f"ids = torch.tensor([[1, 2, {faults.NAN_ALWAYS}]])\n"
        "h, _ = load_bundle(sys.argv[1]).module(ids, None, torch.tensor([3]), False, [])\n"
        "print(bool(torch.isnan(h).all()))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script, str(bundle_dir)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["True", "True"]


def test_vocab_must_hold_the_sentinels() -> None:
    from tests.support.model_helpers import tiny

    with pytest.raises(ValueError, match="vocab_size must exceed 99, got 64"):
        faults.FaultModel(tiny(vocab_size=64))
