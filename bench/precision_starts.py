"""How steady `precision=auto`'s warm-up choice is across starts, quiet or beside other work.

    python -m bench.precision_starts [--source DIR] [--model BUNDLE] [--starts 6] [--hog]

Each of `--starts` fresh processes loads the bundle as a serving process does at start-up
(service/runner.py `Runner.load` with the service's defaults: precision auto, the default worker split's
runner), from the checkout `--source` (default: this one), and prints the precision it chose and why.
With `--hog`, one busy-looping process (one core's worth of other work) runs beside each start, from
just before the load until it returns, `--hog-limit` seconds at most. The model is all-MiniLM-L6-v2
converted by `--source`'s code (bench/ab.py `minilm_bundle`) unless `--model` names a bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.ab import minilm_bundle

ROOT = Path(__file__).resolve().parents[1]
LOAD = """
import json, sys
from prometheus_client import CollectorRegistry
from service.config import ServiceConfig
from service.engine import model_workers
from service.metrics import Metrics
from service.runner import Runner
config = ServiceConfig(model=sys.argv[1])
spec = Runner(config, sys.argv[1], Metrics(CollectorRegistry()), model_workers(config)).load()
print(json.dumps({"precision": spec.precision, "reason": spec.precision_reason}))
"""
SPEED = re.compile(r"bf16 (?:not chosen: )?([0-9.]+)x fp32's speed")  # the reason's bf16 figure (service/tuning.py)


def start(source: Path, bundle: Path, hog: bool, hog_limit: float) -> dict[str, str]:
    """One fresh process's choice: {"precision", "reason"}; beside a busy loop when `hog`."""
    busy = subprocess.Popen(["timeout", str(hog_limit), sys.executable, "-c", "while True: pass"]) if hog else None
    try:
        done = subprocess.run([sys.executable, "-c", LOAD, str(bundle)], cwd=source, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(source)}, timeout=300, check=True)
    finally:
        if busy is not None:
            busy.terminate()
            busy.wait()
    choice: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return choice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout whose service code loads the model")
    parser.add_argument("--model", type=Path, default=None, help="bundle (default: all-MiniLM-L6-v2, converted)")
    parser.add_argument("--starts", type=int, default=6)
    parser.add_argument("--hog", action="store_true", help="a busy-looping process beside each start")
    parser.add_argument("--hog-limit", type=float, default=120.0, help="seconds a hog may run at most")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    bundle = args.model or minilm_bundle(source)
    chosen: list[str] = []
    speeds: list[str] = []
    for i in range(args.starts):
        before = os.getloadavg()[0]
        choice = start(source, bundle, args.hog, args.hog_limit)
        chosen.append(choice["precision"])
        speeds += SPEED.findall(choice["reason"])
        print(f"start {i} (load average {before:.2f}): {choice['precision']}: {choice['reason']}", flush=True)
    counts = ", ".join(f"{name} {chosen.count(name)}" for name in sorted(set(chosen)))
    print(f"{source}, {'with' if args.hog else 'without'} a hog: {counts} of {len(chosen)} starts; bf16 timed at "
          f"{' '.join(speeds) or '-'}x fp32's speed; load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
