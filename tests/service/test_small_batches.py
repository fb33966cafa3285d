"""Small batches on one intra-op thread (Runner._fit_threads): below `small_batch_work` (batch tokens x
d_model x layers) a CPU batch runs on one thread whatever width the batcher set; at or above it, on that
width. The real tiny model (d_model 32, 2 layers: 64 work per token), so 256 tokens is the default line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from service.jobs import Job
from service.metrics import Metrics
from service.runner import Runner
from tests.support.helpers import test_config


def _runner(bundle: Path, workers: int = 1, **overrides: object) -> Runner:
    runner = Runner(test_config(bundle, torch_threads=2, **overrides), str(bundle), Metrics(CollectorRegistry()),
                    workers=workers)
    runner.load()
    return runner


def _threads_of(runner: Runner, rows: int, length: int) -> int:
    outputs, _ = runner.execute([Job(np.arange(length) % 90, None)] * rows)
    assert all(o.hidden is not None for o in outputs)  # type: ignore[union-attr]
    return torch.get_num_threads()  # what OpenMP used for the batch: set on this thread, per thread


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_batch_below_the_work_line_runs_on_one_thread_and_one_above_on_the_width_set(tiny_bundle: Path):
    runner = _runner(tiny_bundle)
    runner.set_wide(True)
    assert _threads_of(runner, 1, 8) == 1  # 8 x 32 x 2 = 512 < 16384
    assert _threads_of(runner, 4, 64) == 2  # 4 x 64 x 32 x 2 = 32768: the width set_wide asked for
    assert _threads_of(runner, 3, 42) == 1  # 3 x 42 x 64 = 8064: back to one, without another set_wide


def test_narrow_batches_keep_their_share_and_zero_turns_the_rule_off(tiny_bundle: Path):
    narrow = _runner(tiny_bundle, workers=2)
    narrow.set_wide(False)
    assert _threads_of(narrow, 8, 64) == 1  # one worker's share of two threads
    narrow.set_wide(True)
    assert _threads_of(narrow, 8, 64) == 2
    off = _runner(tiny_bundle, small_batch_work=0)
    off.set_wide(True)
    assert _threads_of(off, 1, 1) == 2
