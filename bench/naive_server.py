"""The naive unbatched server: the simplest correct gRPC server of a bundle that a team would write first,
the bar that `make bench` (bench/service_bench.py) measures the service's batching and serving against.

grpc.aio on 127.0.0.1, the same contract (proto/attention/v1): `Encode` with token ids in and hidden
states out, and `GetModelInfo`, which the load generator (client/load.py) asks once before a run; every
other method answers UNIMPLEMENTED (gRPC's own answer for a method nobody registered). The bundle is
loaded with `model.bundle.load_bundle` at the precision and intra-op thread count it is given (the
service's, in the benchmark). Each call's sequences are padded into one batch and run as one forward;
no call waits for another to share a batch.

The forward runs on one worker thread (a `ThreadPoolExecutor(max_workers=1)`), not on
`asyncio.to_thread`: the forward is already parallel inside (torch's intra-op threads take every core),
so a team that sets the thread count to the cores runs one forward at a time; `asyncio.to_thread`'s
default pool (min(32, cores + 4) threads) would run several of those wide forwards side by side on the
same cores, and what the baseline lost to that oversubscription (not measured here) would be counted
as the service's gain, by an amount that depends on the core count. One worker is the stronger of the
two first drafts, so the ratio against it does not flatter the service.

Its forward is the in-process one (bench/model_bench.py: the bundle called on the thread that loaded
it), so every ratio against it measures serving, not a different forward. That takes two things a first
draft gets wrong without noticing:
- the bundle is loaded and warmed up on the forward thread itself, not on the main thread. With
  OpenMP each thread that runs a parallel region gets a team of its own: loading on the main thread
  (the cast and freeze run parallel ops) left a second team there, one more OpenMP thread, and libgomp
  spins far less at its barriers once its threads outnumber the cores. So the forward was not the
  in-process one: slower on a quiet machine (bench/RESULTS.md, load under 2.6, fixed 128 at c1: p50
  16.9 ms against an in-process 11.3 ms, 8.8 against 4.4 on the Xeon), and on a busy one faster than
  the in-process forward, whose spinning threads wait for descheduled ones (2026-12-03, load 11,
  compute per call 17.7 ms against 573 ms in process; now 532 ms, 0.91 of it). The service
  keeps one team the same way (service/batching/threads.py, its lead thread);
- the GIL switch interval is the service's (0.5 ms, service/engine.py SWITCH_INTERVAL_S): at 5 ms
  the forward thread waits up to that long for the GIL behind the event loop before and after each
  forward under concurrency.
Its event loop is the service's default too (service/event_loop.py: uvloop where installed), and like the
service it freezes its start-up heap before it serves (service/process.py `freeze_heap`), neither of which a first
draft would do: the loop's CPU and the garbage collector's pauses are costs of serving either way, so the bar
gets the cheaper ones.

The response is built with proto/attention/v1/codec.py (`fill_tensor`, the codec's in-place path for
responses). Bad input gets INVALID_ARGUMENT naming the field; an option this server does not do
(pooling, attention, text, ...) gets UNIMPLEMENTED; a failed forward gets INTERNAL.

Run: `python -m bench.naive_server --model DIR --port 0 [--precision fp32] [--torch-threads N]
[--ready-file PATH]`. It prints `listening on 127.0.0.1:PORT` and, with `--ready-file`, writes
{"port": PORT, "pid": PID} there (atomically) once it serves; SIGTERM or SIGINT stops it.
`NaiveProcess` starts one in a subprocess and reads its port back, as tests/support/server_process.py
does for the service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from model.bundle import LoadedBundle, load_bundle
from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1.codec import SERVICE_NAME, TensorError, fill_tensor, from_tensor
from service import event_loop
from service.device import DTYPES, default_threads
from service.engine import SWITCH_INTERVAL_S
from service.process import freeze_heap

ROOT = Path(__file__).resolve().parents[1]
MAX_SEQUENCES = 64
OUTPUT_DTYPES = (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16)


class BadRequest(Exception):
    """The call is refused with `code` and a message naming the field."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class NaiveServicer:
    """Encode and GetModelInfo of one loaded bundle, one forward per call on one worker thread."""

    def __init__(self, bundle: Path, precision: str, threads: int) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="forward", initializer=torch.set_num_threads,
                                       initargs=(threads,))
        # Loaded and warmed on the forward thread: one OpenMP team in the process (module docstring).
        loaded = self.pool.submit(self._load, bundle, precision).result()
        self.module, self.manifest, self.precision = loaded.module, loaded.manifest, precision
        self.config = loaded.manifest.config

    @staticmethod
    def _load(bundle: Path, precision: str) -> LoadedBundle:
        """On the forward thread: load the bundle, then two forwards of a short row (TorchScript profiles and
        optimises a graph on its first calls; the load generator's warm-up covers the shapes it sends)."""
        loaded = load_bundle(bundle, dtype=DTYPES[precision])
        ids = torch.zeros((1, min(8, loaded.manifest.config.max_length)), dtype=torch.int64)
        with torch.inference_mode():
            for _ in range(2):
                loaded.module(ids, None, torch.tensor([ids.shape[1]]), False, [])
        return loaded

    def model_info(self) -> pb.ModelInfo:
        c, m = self.config, self.manifest
        return pb.ModelInfo(
            name=m.name, version=m.version, checksum=m.sha256, d_model=c.d_model, n_heads=c.n_heads,
            n_layers=c.n_layers, vocab_size=c.vocab_size, max_length=c.max_length, positional=c.positional,
            precision=self.precision, device="cpu", precision_reason="configured", tasks=["embed"],
            limits=pb.Limits(max_sequences_per_call=MAX_SEQUENCES, max_tokens_per_call=MAX_SEQUENCES * c.max_length,
                             max_message_bytes=4 << 20),
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self.model_info()

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        try:
            rows = self.check(request)
        except BadRequest as exc:
            await context.abort(exc.code, str(exc))
        submitted = time.perf_counter()
        try:
            hidden, started, seconds = await asyncio.get_running_loop().run_in_executor(self.pool, self.forward, rows)
        except Exception as exc:  # the model failed: say so, never UNKNOWN
            await context.abort(grpc.StatusCode.INTERNAL, f"forward failed: {type(exc).__name__}: {exc}")
        response = pb.EncodeResponse(request_id=request.request_id)
        dtype = request.output.dtype or pb.DTYPE_FLOAT32
        for ids, h in zip(rows, hidden, strict=True):
            out = response.outputs.add(token_count=len(ids))
            fill_tensor(out.hidden, h, dtype)
        meta = response.metadata
        meta.queue_us, meta.compute_us = int((started - submitted) * 1e6), int(seconds * 1e6)
        meta.batch_size, meta.padded_length = len(rows), max(map(len, rows))
        meta.precision, meta.device = self.precision, "cpu"
        meta.model_name, meta.model_version = self.manifest.name, self.manifest.version
        return response

    def check(self, request: pb.EncodeRequest) -> list[np.ndarray]:
        """The call's token ids, one array per sequence; BadRequest for what this server cannot run."""
        invalid, unimplemented = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED
        out = request.output
        for present, field in ((request.attention.return_attention, "attention.return_attention"),
                               (request.causal, "causal"), (out.pooling != pb.POOLING_NONE, "output.pooling"),
                               (out.HasField("return_hidden") and not out.return_hidden, "output.return_hidden"),
                               (out.HasField("normalize"), "output.normalize"), (out.dimensions, "output.dimensions"),
                               (out.quantization, "output.quantization"), (out.HasField("sparse"), "output.sparse"),
                               (out.return_tokens, "output.return_tokens"), (out.prompt_name, "output.prompt_name"),
                               (request.truncate or request.long_inputs > pb.LONG_INPUTS_ERROR, "long_inputs")):
            if present:
                raise BadRequest(unimplemented, f"{field}: the naive server returns hidden states only")
        if out.dtype not in OUTPUT_DTYPES:
            raise BadRequest(invalid, f"output.dtype must be FLOAT32, FLOAT16 or BFLOAT16; got {out.dtype}")
        if not 1 <= len(request.sequences) <= MAX_SEQUENCES:
            raise BadRequest(invalid, f"sequences: 1..{MAX_SEQUENCES} per call; got {len(request.sequences)}")
        rows = []
        for i, sequence in enumerate(request.sequences):
            where = f"sequences[{i}].token_ids"
            if sequence.WhichOneof("input") != "token_ids":
                raise BadRequest(unimplemented, f"sequences[{i}]: the naive server takes token_ids only")
            if sequence.token_ids.dtype not in (pb.DTYPE_INT32, pb.DTYPE_INT64):
                raise BadRequest(invalid, f"{where}: dtype must be INT32 or INT64")
            try:
                ids = from_tensor(sequence.token_ids)
            except TensorError as exc:
                raise BadRequest(invalid, f"{where}: {exc}") from None
            if ids.ndim != 1 or not 1 <= len(ids) <= self.config.max_length:
                raise BadRequest(invalid, f"{where}: shape must be [T] with 1 <= T <= {self.config.max_length}; "
                                          f"got {list(ids.shape)}")
            if ids.min() < 0 or ids.max() >= self.config.vocab_size:
                raise BadRequest(invalid, f"{where}: ids must be in 0..{self.config.vocab_size - 1}")
            rows.append(ids)
        return rows

    def forward(self, rows: list[np.ndarray]) -> tuple[list[np.ndarray], float, float]:
        """One padded forward of the call's sequences: (hidden [T_i, d_model] float32 each, when it
        started by perf_counter, its seconds)."""
        started = time.perf_counter()
        lengths = [len(ids) for ids in rows]
        batch = torch.zeros((len(rows), max(lengths)), dtype=torch.int64)
        for i, ids in enumerate(rows):
            batch.numpy()[i, : len(ids)] = ids
        with torch.inference_mode():
            hidden = self.module(batch, None, torch.tensor(lengths), False, [])[0].float()
        return [hidden[i, :n].numpy() for i, n in enumerate(lengths)], started, time.perf_counter() - started


async def serve(servicer: NaiveServicer, host: str, port: int, ready_file: str) -> None:
    server = grpc.aio.server()
    handlers = {
        "Encode": grpc.unary_unary_rpc_method_handler(
            servicer.Encode, request_deserializer=pb.EncodeRequest.FromString,
            response_serializer=pb.EncodeResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"listening on {host}:{bound}", flush=True)
    if ready_file:
        from service.process import write_ready_file

        write_ready_file(ready_file, {"port": bound, "pid": os.getpid()})
    await stop.wait()
    await server.stop(grace=1.0)
    servicer.pool.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.naive_server", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the bundle directory")
    parser.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"], help="loopback only")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free one (printed, and in --ready-file)")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--torch-threads", type=int, default=0, help="intra-op threads (0 = one per core)")
    parser.add_argument("--ready-file", default="", help="write {port, pid} as JSON here once serving")
    args = parser.parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the service's (module docstring)
    servicer = NaiveServicer(args.model, args.precision, args.torch_threads or default_threads())
    freeze_heap()  # the service's, once serving (module docstring)
    event_loop.run(serve(servicer, args.host, args.port, args.ready_file), "auto")  # the service's default
    return 0


class NaiveProcess:
    """`python -m bench.naive_server` in a subprocess on 127.0.0.1:0; `target` once it serves. Its
    output goes to a log file in a temporary directory; `stop()` sends SIGTERM and waits."""

    def __init__(self, bundle: Path, *flags: str, timeout: float = 120.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="naive-server-")
        ready = Path(self._tmp.name) / "ready.json"
        self.log = Path(self._tmp.name) / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.naive_server", "--model", str(bundle), "--port", "0",
                 "--ready-file", str(ready), *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"naive server not serving within {timeout:.0f} s (exit {self.proc.returncode}):"
                                   f"\n{self.output()[-3000:]}")
            time.sleep(0.05)
        self.ports: dict[str, Any] = json.loads(ready.read_text())
        self.target = f"127.0.0.1:{self.ports['port']}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
