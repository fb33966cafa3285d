"""Edge processes (`edge_processes` > 0): several gRPC edge processes in front of one model process.

The model process (`python -m service`, service/multiproc/host.py) owns the device, the runner, the
model threads and the one batcher, so batching spans every caller of the device. It serves a Unix
socket in a private directory. Each edge process (service/multiproc/edge_worker.py) runs the whole
gRPC server (every front door, parsing, validation, tokenizing, auth, the metrics interceptor) on the
shared port (SO_REUSEPORT), and admits into the model process's batcher through
service/multiproc/remote.py, which `Calls.compute` uses as it uses the batcher. The frames between
them are service/multiproc/frames.py. Metrics are prometheus_client's multiprocess mode: one /metrics,
served by the model process, summing every process.
"""
