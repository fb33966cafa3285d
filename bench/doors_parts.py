"""What the edge's own pieces cost, in process, one at a time (issue 22): per call on the event loop
(parse and validate, build and serialize the response, the request metrics; a 128 KiB answer serialized in a
loop turn or handed to a worker thread and back) and per batch on the model thread (the batch choice, the
batch metrics). Timed on whatever tree is first on the path, so two trees
compare as

    PYTHONPATH=/path/to/other/checkout python bench/doors_parts.py
    PYTHONPATH=. python bench/doors_parts.py

Prints a markdown table: the minimum over `--repeat` runs of `--number` calls, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import sys
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from client.messages import EncodeOptions, build_request
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import fill_tensor
from service.batching import Done
from service.batching.choice import choose_batch
from service.batching.types import BatchLimits
from service.config import ServiceConfig
from service.jobs import ModelSpec, Output
from service.metrics import Metrics

try:
    from service.doors.attention_wire import NAMES, encode_ask, encode_response, response_bytes
    from service.doors.calls import Ran
    from service.plan import plan

    def validate(request: Any, spec: ModelSpec, config: ServiceConfig) -> Any:
        return plan(encode_ask(request, spec, config), spec, config, NAMES, response_bytes)

    def respond(plan: Any, done: list[Done], spec: ModelSpec) -> Any:
        return encode_response(Ran(plan, spec, done, [d.output for d in done]))
except ImportError:  # a tree from before the one call path (issue 38)
    from service.doors.attention_v1 import _response  # type: ignore[attr-defined,no-redef]
    from service.doors.attention_v1 import plan_request as validate  # type: ignore[attr-defined,no-redef]

    def respond(plan: Any, done: list[Done], spec: ModelSpec) -> Any:
        # Before long inputs (issue 21) the response took no per-sequence outputs.
        outputs = ([d.output for d in done],) if len(inspect.signature(_response).parameters) == 4 else ()
        return _response(plan, done, *outputs, spec)


@contextlib.contextmanager
def parts() -> Iterator[list[tuple[str, Callable[[], Any]]]]:
    spec = ModelSpec(name="edge", version="1", checksum="x", d_model=32, n_heads=4, n_layers=1, vocab_size=100,
                     max_length=64, positional="sinusoidal", precision="fp32", device="cpu", tokenizer=None,
                     attention_scale=32 ** -0.5, standard_scale=True, relative_bias="none")
    config = ServiceConfig()
    raw = build_request([np.arange(16, dtype=np.int64)], EncodeOptions(), request_id="bench-1").SerializeToString()
    parse = pb.EncodeRequest.FromString
    plan = validate(parse(raw), spec, config)
    done = [Done(Output(np.zeros((16, 32), np.float32), None, None, False), 0.001, 0.001, 8, 16)]
    metrics = Metrics(CollectorRegistry())
    limits = BatchLimits(max_batch_tokens=1024, max_batch_size=64)
    ages8 = [0.001 * i for i in range(8, 0, -1)]  # oldest first
    # A 128 KiB answer (128 tokens x 256 floats) serialized on a loop, or handed to a worker thread and back as
    # service/doors/rpc.py `serialize` does past SERIALIZE_INLINE_BYTES; both run one loop turn, so the
    # difference is the hand-off.
    loop = asyncio.new_event_loop()
    answer = pb.Tensor()
    fill_tensor(answer, np.ones((128, 256), np.float32))

    async def on_loop() -> bytes:
        return answer.SerializeToString()

    async def handed_off() -> bytes:
        return await asyncio.to_thread(answer.SerializeToString)

    try:
        yield [
            ("parse + validate, one 16-id sequence (event loop, per call)", lambda: validate(parse(raw), spec, config)),
            ("build and serialize the response (event loop, per call)",
             lambda: respond(plan, done, spec).SerializeToString()),
            ("attention_requests_total + duration (per call)", lambda: metrics.observe_request("Encode", "OK", 0.01)),
            ("choose_batch, 4 mixed lengths (model thread, per batch)",
             lambda: choose_batch([16, 17, 18, 19], [0.004, 0.003, 0.002, 0.001], limits)),
            ("choose_batch, 8 mixed lengths", lambda: choose_batch(list(range(16, 24)), ages8, limits)),
            ("choose_batch, 8 calls of 16 tokens", lambda: choose_batch([16] * 8, ages8, limits)),
            ("on_batch, 8 sequences (model thread, per batch)",
             lambda: metrics.on_batch(8, 16, 128, [0.001] * 8, True)),
            ("serialize a 128 KiB answer in a loop turn (event loop, per call)",
             lambda: loop.run_until_complete(on_loop())),
            ("the same in a worker thread and back (asyncio.to_thread)", lambda: loop.run_until_complete(handed_off())),
        ]
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/doors_parts.py", description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    if not (1 <= args.number <= 100_000 and 1 <= args.repeat <= 50):
        parser.error("--number must be in 1..100000 and --repeat in 1..50")
    print("| piece | us |\n|---|---:|")
    with parts() as pieces:
        for name, fn in pieces:
            seconds = min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number
            print(f"| {name} | {1e6 * seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
