"""`ServiceConfig`: one frozen config, from CLI flags with `ATTN_*` environment fallbacks.

This is the only module that reads the environment. Every field has a default and a help text
(`python -m service --help` prints them all) and is validated on construction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "precision": ("auto", "fp32", "fp16", "bf16"),
    "nonfinite_policy": ("retry", "fail"),
    "pipeline": ("auto", "on", "off"),
    "backend": ("auto", "torchscript", "aoti"),
    "log_level": ("debug", "info", "warning", "error"),
}


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-service")


def _opt(default: Any, help: str, *, env: bool = True) -> Any:
    return field(default=default, metadata={"help": help, "env": env})


@dataclass(frozen=True)
class ServiceConfig:
    # Network
    host: str = _opt("127.0.0.1", "address to bind the gRPC port (the container sets 0.0.0.0)")
    port: int = _opt(50051, "gRPC port (0 picks a free one; see --ready-file)")
    metrics_host: str = _opt("", "address of the Prometheus /metrics HTTP port (empty = same as host)")
    metrics_port: int = _opt(9464, "Prometheus /metrics HTTP port (0 picks a free one, -1 disables it)")
    health_port: int = _opt(
        -1, "extra plaintext port serving only grpc.health.v1, for probes when TLS is on (-1 = off, 0 = a free one)")
    http_port: int = _opt(8000, "HTTP port of the OpenAI, TEI, KServe v2 REST and attention.v1 JSON routes "
                                "(docs/http.md; 0 picks a free one, -1 disables it); TLS and tokens as the gRPC port's")
    http_read_timeout_s: float = _opt(30.0, "an HTTP request whose body has not arrived within this is answered 408")
    http_keepalive_s: float = _opt(75.0, "an idle HTTP keep-alive connection is closed after this")
    ready_file: str = _opt("", "write {port, metrics_port, health_port, pid} as JSON here once SERVING")
    # Model
    model: str = _opt("", "model bundle directory, or a Hugging Face model folder (converted into cache_dir on "
                      "first use, as convert-hf does); empty = the built-in default model, built on first use")
    cache_dir: str = _opt("", "where the built-in default bundle and converted Hugging Face folders are built "
                          "(default ~/.cache/attention-service)")
    device: str = _opt("auto", "auto | cpu | cuda (auto = cuda when available)")
    precision: str = _opt("auto", "auto | fp32 | fp16 | bf16 (auto = bf16 on cuda; on cpu the fastest at warm-up "
                                  "that agrees with fp32, docs/performance.md)")
    backend: str = _opt("auto", "auto | torchscript | aoti: what runs the serving forward; aoti needs the bundle's "
                                "model.pt2 (python -m model compile-aoti) for this torch, device and precision, "
                                "else start-up fails; auto = aoti on cpu where the bundle has a usable model.pt2 "
                                "(measured faster, docs/performance.md), else torchscript")
    nonfinite_policy: str = _opt("retry", "on NaN/Inf under fp16/bf16: retry (re-run in fp32) | fail")
    torch_threads: int = _opt(0, "intra-op threads for the model on CPU (0 = one per core)")
    model_workers: int = _opt(0, "CPU batches computed side by side, each with an equal share of torch_threads; "
                                 "a batch that runs alone gets them all (0 = on cpu, 1 or 2 as measured side by side "
                                 "at warm-up, docs/performance.md, or 2 without warm-up; 1 on cuda)")
    small_batch_work: int = _opt(16384, "a CPU batch below this much work (batch tokens x d_model x layers) runs on "
                                        "one intra-op thread, however many it may use (0 = never)")
    warmup: bool = _opt(True, "run warm-up forwards before reporting SERVING")
    # Names (docs/http.md "Coming from TEI")
    served_model_name: str = _opt("", "the name the model is served as, everywhere a name is shown (OpenAI, TEI "
                                      "/info, KServe, ModelInfo, metrics); empty = the bundle's own name")
    model_alias: str = field(default="", metadata={
        "help": "more names the model answers to (comma-separated, or the flag repeated), e.g. "
                "text-embedding-3-small for clients that default to it", "env": True, "repeat": True})
    # TEI and OpenAI dialects (docs/http.md)
    auto_truncate: bool = _opt(True, "TEI's and OpenAI's routes cut a text over the model's limit unless the call "
                                     "says truncate=false (as TEI 1.9); attention.v1 and KServe keep long_inputs")
    openai_token_ids: bool = _opt(False, "take token ids on /v1/embeddings as this model's own (off: 400, since "
                                         "OpenAI clients such as LangChain's send tiktoken ids by default)")
    # Batching
    max_batch_tokens: int = _opt(0, "token budget of one batch, counted as batch size x padded length (0 = where "
                                    "throughput stops growing at warm-up; without warm-up 1024 on cpu, 16384 on "
                                    "cuda; at least the model's max_length)")
    max_batch_size: int = _opt(64, "most sequences in one batch")
    max_wait_ms: float = _opt(0.0, "hold a not-full batch open up to this long to grow it (0 = never wait)")
    max_age_ms: float = _opt(500.0, "a sequence queued this long is batched next, whatever its length")
    max_queue_tokens: int = _opt(262144, "queued tokens beyond which calls get RESOURCE_EXHAUSTED at once")
    max_queue_requests: int = _opt(4096, "queued sequences beyond which calls get RESOURCE_EXHAUSTED at once")
    pipeline: str = _opt("auto", "auto | on | off: prepare the next batch while the device runs this one "
                                 "(auto = on for cuda, off for cpu)")
    # Attention health (docs/attention-health.md)
    diagnostics_sample: float = _opt(
        0.01, "fraction of batches whose attention health (per layer: max |pre-softmax score|, normalised "
              "entropy) is recomputed on the explicit path after their results are delivered (0 = off, no cost)")
    diagnostics_overflow_fraction: float = _opt(
        0.5, "a sampled score beyond this fraction of the serving dtype's largest finite value counts in "
             "attention_score_overflow_risk_total (fp16: 0.5 x 65504)")
    entropy_baseline: str = _opt(
        "", "this deployment's normal normalised attention entropy: one value for every layer, or one per layer "
            "comma-separated (exported as attention_entropy_baseline; the collapse alerts compare with it)")
    # Per-call limits
    max_sequences_per_call: int = _opt(64, "most sequences in one Encode call")
    max_tokens_per_call: int = _opt(32768, "most tokens (all sequences together) in one Encode call")
    max_message_bytes: int = _opt(64 << 20, "largest request or response message, bytes")
    max_text_chars: int = _opt(1 << 20, "most characters of text (all sequences together) in one Encode call, "
                                        "checked before tokenizing")
    max_attention_bytes: int = _opt(16 << 20, "attention weights budget per call, bytes (as returned)")
    allow_attention: bool = _opt(True, "serve attention weights on request (off: FAILED_PRECONDITION)")
    default_timeout_s: float = _opt(30.0, "deadline applied to calls that carry none (a caller's own is kept); "
                                          "also bounds the wait for a unary call's request message")
    max_stream_inflight: int = _opt(64, "requests one EncodeStream may have in flight")
    # Connection limits (grpc core, per HTTP/2 connection; see grpc_options in service/doors/grpc_server.py)
    max_concurrent_streams: int = _opt(
        1024, "calls one connection may have open at once (about 14 KB of server memory each while open); "
              "past it some calls fail UNAVAILABLE (REFUSED_STREAM, never seen by a handler: safe to retry), "
              "without touching other connections (docs/limits.md)")
    max_connections: int = _opt(
        0, "connections the gRPC port, and the HTTP port, each keep open at once; one more is closed as it is "
           "accepted (0 = a quarter of the process's file-descriptor limit, at most 8192; docs/limits.md)")
    max_connection_idle_s: float = _opt(600.0, "a connection with no call for this long is closed with GOAWAY; "
                                               "clients reconnect on their next call (0 = never)")
    max_connection_age_s: float = _opt(
        1800.0, "a connection this old (jittered by up to a tenth) gets GOAWAY: new calls go to a new "
                "connection, so load spreads over new replicas, and nothing on a connection can outlive "
                "age + grace (0 = never)")
    max_connection_age_grace_s: float = _opt(60.0, "calls still open this long after the GOAWAY of "
                                                   "max_connection_age_s are cut and the connection closed")
    keepalive_time_s: float = _opt(60.0, "ping a connection that has been quiet this long, to find dead peers")
    keepalive_timeout_s: float = _opt(20.0, "close a connection whose ping is not answered within this")
    # Lifecycle
    edge_processes: int = _opt(
        0, "gRPC edge processes (front doors, parsing, tokenizing) in front of one model process that owns the "
           "device and the one batcher, sharing the gRPC port (docs/edge-processes.md; 0 = one process "
           "does both)")
    drain_delay_s: float = _opt(0.0, "on SIGTERM, keep serving this long after NOT_SERVING (load balancers)")
    drain_grace_s: float = _opt(10.0, "on SIGTERM, time accepted calls get to finish before UNAVAILABLE")
    reflection: bool = _opt(True, "register gRPC server reflection (switch off in production)")
    log_level: str = _opt("info", "debug | info | warning | error")
    min_deadline_ms: float = _opt(1.0, "calls arriving with less time than this left get DEADLINE_EXCEEDED at once")
    # Security (see service/doors/security.py)
    tls_cert: str = _opt("", "PEM server certificate (chain); with --tls-key, the gRPC port speaks TLS only")
    tls_key: str = _opt("", "PEM private key of --tls-cert")
    tls_client_ca: str = _opt("", "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)")
    auth_tokens_file: str = _opt("", "file of bearer tokens, one per line (# comments); when set, calls need one")
    # Secret: environment only (never a flag, so never in `ps` or --help), never in repr or logs.
    auth_tokens: str = field(default="", repr=False, metadata={
        "help": "comma-separated bearer tokens, environment only", "env": True, "flag": False})
    # Fault hooks: delays at named points of the request path, to widen race windows in tests.
    allow_fault_hooks: bool = _opt(False, "allow the fault_delay_* test hooks (never in production)")
    fault_delay_after_admit_ms: float = _opt(0.0, "test hook: a queued sequence becomes batchable only this late")
    fault_delay_after_dequeue_ms: float = _opt(0.0, "test hook: the model thread waits this long before a forward")
    fault_delay_before_scatter_ms: float = _opt(0.0, "test hook: ... and this long before resolving the results")
    fault_delay_in_shutdown_ms: float = _opt(0.0, "test hook: shutdown waits this long after refusing new calls")
    fault_delay_before_ready_ms: float = _opt(0.0, "test hook: start-up waits this long before loading the model")

    @property
    def connection_limit(self) -> int:
        """Connections each port keeps open at once: `max_connections`, else a quarter of the descriptor limit
        (the two ports, the model's files and the process's own sockets share the rest), at most 8192."""
        if self.max_connections:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(64, min(8192, soft // 4)) if soft != resource.RLIM_INFINITY else 8192

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} must be one of {'|'.join(choices)}; got {value!r}")
        _check("port", self.port, 0, 65535)
        for name in ("metrics_port", "health_port", "http_port"):
            _check(name, getattr(self, name), -1, 65535)
        for name in (
            "max_batch_size", "max_queue_tokens", "max_queue_requests",
            "max_sequences_per_call", "max_tokens_per_call", "max_message_bytes", "max_attention_bytes",
            "max_stream_inflight", "max_concurrent_streams", "max_text_chars",
        ):
            _check(name, getattr(self, name), 1, None)
        _check("torch_threads", self.torch_threads, 0, None)
        _check("edge_processes", self.edge_processes, 0, 64)
        _check("model_workers", self.model_workers, 0, None)
        _check("max_connections", self.max_connections, 0, None)
        _check("small_batch_work", self.small_batch_work, 0, None)
        for name in ("max_wait_ms", "max_age_ms", "drain_delay_s", "drain_grace_s"):
            _check(name, getattr(self, name), 0, None)
        _check("default_timeout_s", self.default_timeout_s, 1e-3, None)
        _check("http_read_timeout_s", self.http_read_timeout_s, 1e-3, None)
        _check("http_keepalive_s", self.http_keepalive_s, 1e-3, None)
        for name in ("max_connection_idle_s", "max_connection_age_s", "max_connection_age_grace_s"):
            _check(name, getattr(self, name), 0, 2_000_000)  # grpc takes int milliseconds
        for name in ("keepalive_time_s", "keepalive_timeout_s"):
            _check(name, getattr(self, name), 1e-3, 2_000_000)
        _check("min_deadline_ms", self.min_deadline_ms, 0, None)
        hooks = [f.name for f in dataclasses.fields(self) if f.name.startswith("fault_delay_")]
        for name in hooks:
            _check(name, getattr(self, name), 0, 60_000)
        armed = [name for name in hooks if getattr(self, name) > 0]
        if armed and not self.allow_fault_hooks:
            raise ValueError(f"{', '.join(armed)} set, but fault hooks are refused unless allow_fault_hooks is on")
        for name in (self.served_model_name, *self.model_aliases):
            if not name.isprintable() or " " in name or len(name) > 256:
                raise ValueError(f"served_model_name and model_alias must be printable, without spaces, at most "
                                 f"256 characters; got {name[:64]!r}")
        if len(set(self.model_aliases)) != len(self.model_aliases) or self.served_model_name in self.model_aliases:
            raise ValueError(f"model_alias repeats a name: {self.model_alias!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name} must name a readable file; got {path!r}")
        for i, token in enumerate(self.auth_token_list, 1):
            # Never echo a token: it is a secret, and this message goes to the log.
            if not token.isascii() or not token.isprintable() or " " in token:
                raise ValueError(f"auth_tokens: token {i} must be printable ASCII without spaces")
        _check("diagnostics_sample", self.diagnostics_sample, 0, 1)
        _check("diagnostics_overflow_fraction", self.diagnostics_overflow_fraction, 1e-6, 1)
        self.entropy_baselines  # noqa: B018 - parses and checks entropy_baseline
        _check("max_batch_tokens", self.max_batch_tokens, 0, None)
        if self.max_batch_tokens and self.max_batch_size > self.max_batch_tokens:
            raise ValueError(
                f"max_batch_size ({self.max_batch_size}) cannot exceed max_batch_tokens ({self.max_batch_tokens})"
            )

    @property
    def entropy_baselines(self) -> tuple[float, ...]:
        """entropy_baseline parsed: () unset, one value for all layers, or one per layer."""
        if not self.entropy_baseline.strip():
            return ()
        try:
            values = tuple(float(v) for v in self.entropy_baseline.split(","))
        except ValueError:
            raise ValueError(f"entropy_baseline must be numbers in 0..1, comma-separated; got "
                             f"{self.entropy_baseline!r}") from None
        for v in values:
            _check("entropy_baseline", v, 0, 1)
        return values

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """model_alias parsed: the names, in order (comma-separated; a repeated flag was joined with commas)."""
        return tuple(n.strip() for n in self.model_alias.split(",") if n.strip())

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def auth_token_list(self) -> list[str]:
        """The tokens given in the environment (the file's are read by service/doors/security.py)."""
        return [t.strip() for t in self.auth_tokens.split(",") if t.strip()]

    @property
    def hooks_armed(self) -> bool:
        return any(getattr(self, f.name) > 0 for f in dataclasses.fields(self) if f.name.startswith("fault_delay_"))

    @property
    def bundle_cache_dir(self) -> Path:
        return Path(self.cache_dir or _default_cache_dir())

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServiceConfig:
        """Flags win over `ATTN_<NAME>` environment variables, which win over defaults."""
        env = os.environ if env is None else env
        args = build_parser().parse_args(argv)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            flag_value = getattr(args, f.name, None)
            env_value = env.get(f"ATTN_{f.name.upper()}")
            if flag_value is not None:
                values[f.name] = ",".join(flag_value) if isinstance(flag_value, list) else flag_value
            elif env_value is not None:
                values[f.name] = _parse(f, env_value)
        return cls(**values)


def _check(name: str, value: float, low: float, high: float | None) -> None:
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}; got {value!r}")


def _kind(f: dataclasses.Field[Any]) -> type:
    return {"int": int, "float": float, "bool": bool}.get(str(f.type), str)


def _parse(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = _kind(f)
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return lowered in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError:
        raise ValueError(f"ATTN_{f.name.upper()} must be a {kind.__name__}; got {raw!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m service",
        description="gRPC inference service for multi-head-attention encoders. "
        "Every flag falls back to the environment variable shown, then to the default.",
        epilog="Bearer tokens may also be given as ATTN_AUTH_TOKENS (comma-separated; environment only).",
        # No prefixes: `--auth-tokens SECRET` must not pass for --auth-tokens-file and land in an error message.
        allow_abbrev=False,
    )
    for f in dataclasses.fields(ServiceConfig):
        if not f.metadata.get("flag", True):
            continue
        kind = _kind(f)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} [env ATTN_{f.name.upper()}; default {f.default!r}]"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif f.metadata.get("repeat"):
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text,
                                choices=CHOICES.get(f.name))
    return parser
