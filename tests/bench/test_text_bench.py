"""bench.text_bench and client.load's text load, bounded, against the tiny text bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.text_bench import Ceiling, make_texts
from client.load import run_load


def test_texts_are_seeded_and_mixed() -> None:
    texts = make_texts(64, seed=3)
    assert texts == make_texts(64, seed=3) and texts != make_texts(64, seed=4)
    words = sorted(len(t.split()) for t in texts)
    assert words[0] < 10 < 60 < words[-1] <= 200


async def test_text_load_and_ceiling(start_server: Any, tiny_text_bundle: Path) -> None:
    texts = make_texts(32)
    threads = torch.get_num_threads()  # a Ceiling sets this process's; the tests after this one keep theirs
    try:
        ceiling = Ceiling(tiny_text_bundle, texts, threads=1)
        counts = ceiling.token_counts()
        assert set(counts) <= set(range(2, 9)) and ceiling.run(256) > 0  # cut at the bundle's 8 tokens
        side_by_side = Ceiling(tiny_text_bundle, texts, threads=2, workers=2)
        try:
            budget, rate = side_by_side.search()
            assert side_by_side.workers in (1, 2) and budget in (256, 512, 1024, 2048, 4096) and rate > 0
            assert side_by_side.run(256, workers=2) > 0
        finally:
            side_by_side.close()
    finally:
        torch.set_num_threads(threads)
    served = await start_server(bundle=tiny_text_bundle)
    report = await run_load(served.target, concurrency=4, duration_s=None, max_requests=40, pooling="model",
                            return_hidden=False, texts=list(zip(texts, counts, strict=True)), timeout=30)
    assert report.ok == 40 and not report.errors
    assert 2 * 40 <= report.tokens <= 8 * 40
