"""bench/model_bench.py stays runnable: import-safe, FLOP formula, a tiny bounded run writes its report."""

from pathlib import Path

import pytest

from bench import model_bench
from model.bundle import save_bundle
from model.config import REFERENCE
from model.encoder import Encoder
from tests.support.model_helpers import tiny


def test_flop_formula() -> None:
    # 4 layers x (2*4*128*(4*256^2 + 2*256*1024) + 4*4*128^2*256)
    assert model_bench.forward_flops(REFERENCE, 4, 128) == 4 * (1024 * 786432 + 16 * 16384 * 256)


def test_tiny_bounded_run_writes_a_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_bench, "matmul_gflops", lambda dtype, seconds: 10.0)  # keep the test fast
    save_bundle(Encoder(tiny()).init_weights(0), tmp_path / "b", name="tiny", version="1", source="test")
    out = tmp_path / "report.md"
    assert model_bench.main(["--quick", "--budget-s", "1.0", "--bundle", str(tmp_path / "b"), "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    assert len(rows) == 2 * len(model_bench.LENGTHS) * len(model_bench.BATCHES)
    measured = [row for row in rows if "skipped" not in row]
    assert rows[0].startswith("| fp32 | 32 | 1 | ") and rows[0] in measured, "the cheapest shape always runs"
    assert all(float(row.split("|")[5]) > 0 for row in measured)  # seq/s column
    assert len(measured) < len(rows), "a 1 s budget cannot fit every shape at 0.2 s each"
