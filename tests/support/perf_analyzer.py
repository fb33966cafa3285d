"""perf_analyzer 2.60.0 (Triton's load generator) against the KServe v2 door: found, prepared and run.

Its wheel needs glibc 2.38; the shared tool script `../shared/tools/perf_analyzer` (beside the checkout,
outside it; read its header) fetches Debian 13's loader and libraries with apt the first time and runs
the binary through them, passing every argument on. `PERF_ANALYZER` names another script or binary.
Random data cannot drive this model (perf_analyzer sends random values for every input the metadata
lists, an attention_mask of random ints included, which is refused), so the ids (or the texts) come
from a JSON data file that leaves the optional inputs out (the config marks them `optional`).
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOOL_ENV = "PERF_ANALYZER"
SHARED_TOOL = Path("shared", "tools", "perf_analyzer")  # beside the checkout (or beside the main worktree)


def locate() -> Path | None:
    """`$PERF_ANALYZER`, else ../shared/tools/perf_analyzer beside this checkout or beside its main worktree."""
    candidates = [Path(os.environ[TOOL_ENV])] if os.environ.get(TOOL_ENV) else []
    candidates.append(ROOT.parent / SHARED_TOOL)
    try:  # a linked worktree: the main checkout is the common git directory's parent
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        candidates.append(Path(common).parent.parent / SHARED_TOOL)
    except (OSError, subprocess.SubprocessError):
        pass
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def prepare(timeout: float = 300.0) -> tuple[Path | None, str]:
    """The tool, ready to run (the first call downloads about 30 MB), or None and why not."""
    tool = locate()
    if tool is None:
        return None, f"perf_analyzer not found: set {TOOL_ENV}, or provide ../{SHARED_TOOL} beside the checkout"
    try:
        done = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"preparing perf_analyzer took over {timeout:.0f} s (no network to the package mirrors?)"
    if done.returncode != 0 or "Perf Analyzer Version" not in done.stdout + done.stderr:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return None, f"perf_analyzer could not be prepared (exit {done.returncode}): {' | '.join(tail)}"
    return tool, ""


def ids_data(path: Path, *, length: int, vocab: int, rows: int = 16, seed: int = 0) -> Path:
    """A perf_analyzer data file: `rows` requests of `length` random ids in [1, vocab), input_ids only."""
    rng = np.random.default_rng(seed)
    data = [{"input_ids": {"content": rng.integers(1, vocab, length).tolist(), "shape": [length]}}
            for _ in range(rows)]
    path.write_text(json.dumps({"data": data}))
    return path


def text_data(path: Path, texts: list[str]) -> Path:
    """A perf_analyzer data file: one request per text, `text` only (each [1, 1] on the wire)."""
    path.write_text(json.dumps({"data": [{"text": [text]} for text in texts]}))
    return path


@dataclass
class Result:
    returncode: int
    output: str  # stdout and stderr
    rows: list[dict[str, float]]  # the CSV's rows (one per concurrency); empty when none was written

    @property
    def request_count(self) -> int:
        """The measured requests perf_analyzer reports (its last measurement)."""
        counts = re.findall(r"Request count: (\d+)", self.output)
        return int(counts[-1]) if counts else 0


def run(tool: Path, model: str, target: str, data: Path, out: Path, *, length: int | None, concurrency: int,
        requests: int, warmup: int = 0, timeout: float) -> Result:
    """One perf_analyzer measurement over gRPC: `requests` calls in all (after `warmup` unmeasured ones),
    `concurrency` in flight, killed after `timeout` s. A fixed count rather than windows until stable: on
    this shared machine three windows in a row rarely agree within perf_analyzer's stability bound.
    `length`: the ids' (None: a text data file)."""
    out.unlink(missing_ok=True)
    shape = ["--shape", f"input_ids:{length}"] if length is not None else []
    done = subprocess.run(
        [str(tool), "-m", model, "-i", "grpc", "-u", target, "--input-data", str(data), *shape,
         "--concurrency-range", str(concurrency),
         "--request-count", str(requests), "--warmup-request-count", str(warmup), "-f", str(out)],
        capture_output=True, text=True, timeout=timeout)
    rows = []
    if out.exists():
        with out.open() as f:
            rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return Result(done.returncode, done.stdout + done.stderr, rows)
