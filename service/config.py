"""`ServiceConfig`: one frozen config, from CLI flags with `ATTN_*` environment fallbacks.

This is the only module that reads the environment. Every field has a default and a help text
(`python -m service --help` prints them all) and is validated on construction.

Several models (docs/configuration.md, "Several models"): `--model NAME=PATH` repeated, `--models
NAME=PATH,...`, or a models file (`--models-file`, TOML) with per-model settings. Each is a `ModelEntry`;
`ServiceConfig.for_model(entry)` is the config that model runs with (the service's, with the entry's
settings over it). A bare `--model PATH` stays the one-model form, exactly as before (`model`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import resource
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.event_loop import uvloop_installed

CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "precision": ("auto", "fp32", "fp16", "bf16"),
    "nonfinite_policy": ("retry", "fail"),
    "pipeline": ("auto", "on", "off"),
    "backend": ("auto", "torchscript", "aoti"),
    "log_level": ("debug", "info", "warning", "error"),
    "model_control": ("none", "explicit"),
    "otlp_protocol": ("grpc", "http"),
    "event_loop": ("auto", "uvloop", "asyncio"),
}

# What a model may set for itself (models file, `Engine.load_model`); the rest is the service's.
MODEL_SETTINGS = (
    "precision", "backend", "nonfinite_policy", "max_batch_tokens", "max_batch_size", "max_wait_ms", "max_age_ms",
    "max_queue_tokens", "max_queue_requests", "max_sequences_per_call", "max_tokens_per_call", "diagnostics_sample",
)
# A served name: what KServe puts in a URL path (/v2/models/{name}/infer) and a health service name. Aliases
# (what OpenAI callers send as `model`) may hold "/" too ("BAAI/bge-small-en-v1.5").
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}")


@dataclass(frozen=True)
class ModelEntry:
    """One model to serve: its served name ("": the bundle's own, from its manifest), where it is (a bundle
    or a Hugging Face folder), other names callers may use, whether it is the default (calls that name no
    model), and its own settings (names of ServiceConfig fields in MODEL_SETTINGS, with their values)."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    default: bool = False
    settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        what = f"model {self.name!r}" if self.name else f"model {self.path!r}"
        if self.name and not NAME.fullmatch(self.name):
            raise ValueError(f"{what}: a model name is letters, digits and . _ : - (at most 128, starting with a "
                             f"letter or digit); got {self.name!r}")
        if not self.path:
            raise ValueError(f"{what}: path must name a bundle or a Hugging Face folder; got ''")
        for alias in self.aliases:
            if not isinstance(alias, str) or not ALIAS.fullmatch(alias):
                raise ValueError(f"{what}: an alias is letters, digits and . _ : / - (at most 256); got {alias!r}")
        for key, _ in self.settings:
            if key not in MODEL_SETTINGS:
                raise ValueError(f"{what}: {key!r} is not a per-model setting (one of {', '.join(MODEL_SETTINGS)})")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name it answers to that is known before loading (its own, unless from the manifest, and its
        aliases)."""
        return ((self.name,) if self.name else ()) + self.aliases


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-service")


def _opt(default: Any, help: str, *, env: bool = True, repeat: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "env": env, "repeat": repeat})


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
                      "first use, as convert-hf does); empty = the built-in default model, built on first use. "
                      "NAME=PATH serves it as NAME; repeat --model for several models (the first is the default)",
                      repeat=True)
    models: tuple[ModelEntry, ...] = _opt(
        (), "several models: NAME=PATH entries, comma-separated (after those of --model; the first is the default)")
    models_file: str = _opt("", "TOML file of the models to serve and their own settings (docs/configuration.md, "
                                "\"Several models\"); instead of --model and --models")
    memory_budget_mb: int = _opt(0, "most memory the loaded models' weights may take, MiB (device memory on cuda, "
                                    "the process's on cpu): a model that would not fit is refused (0 = no budget)")
    model_control: str = _opt("none", "none | explicit: explicit allows loading and unloading models at run time "
                                      "(KServe's repository API), as Triton's --model-control-mode")
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
    model_alias: str = _opt("", "more names the model answers to (comma-separated, or the flag repeated), e.g. "
                                "text-embedding-3-small for clients that default to it", repeat=True)
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
    gc_freeze: bool = _opt(True, "once SERVING, move what start-up built into CPython's permanent generation "
                                 "(gc.freeze) so full garbage collections skip it: each took ~0.1 s holding the GIL "
                                 "(docs/performance.md)")
    event_loop: str = _opt("auto", "auto | uvloop | asyncio: the event loop the doors run on (auto = uvloop where "
                                   "installed: less CPU a call, docs/performance.md)")
    min_deadline_ms: float = _opt(1.0, "calls arriving with less time than this left get DEADLINE_EXCEEDED at once")
    # Tracing (docs/tracing.md): OpenTelemetry spans exported over OTLP; off, and free, without an endpoint
    otlp_endpoint: str = _opt("", "OTLP collector to export traces to: http://HOST:PORT (plaintext) or "
                                  "https://HOST:PORT (TLS); over http a path other than / is kept as given, else "
                                  "/v1/traces (empty = tracing off: no spans, no cost)")
    otlp_protocol: str = _opt("grpc", "grpc | http: OTLP over gRPC (the collector's port 4317) or over HTTP with "
                                      "protobuf bodies (4318)")
    otlp_service_name: str = _opt("attention-service", "service.name of the traces' resource")
    trace_sample_ratio: float = _opt(1.0, "fraction of calls traced, by trace id (0..1); a caller's traceparent "
                                          "decides for its own calls (sampled or not)")
    otlp_export_delay_ms: float = _opt(2000.0, "finished spans wait at most this long to be exported together "
                                               "(sooner when 512 are waiting)")
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
        self._check_models()
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
        if self.event_loop == "uvloop" and not uvloop_installed():
            raise ValueError("event_loop uvloop: uvloop is not installed (pip install uvloop, or event_loop auto)")
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
        _check("memory_budget_mb", self.memory_budget_mb, 0, None)
        self._check_tracing()
        for entry in self.models:
            try:
                self.for_model(entry)
            except ValueError as e:
                raise ValueError(f"model {entry.name or entry.path!r}: {e}") from None

    def _check_tracing(self) -> None:
        endpoint = self.otlp_endpoint
        if endpoint:
            scheme, _, rest = endpoint.partition("://")
            host = rest.split("/", 1)[0]
            if scheme not in ("http", "https") or not host or " " in endpoint:
                raise ValueError(f"otlp_endpoint must be a URL, http://HOST:PORT (plaintext) or https://HOST:PORT "
                                 f"(TLS); got {endpoint!r}")
        _check("trace_sample_ratio", self.trace_sample_ratio, 0, 1)
        _check("otlp_export_delay_ms", self.otlp_export_delay_ms, 1, 60_000)
        if not self.otlp_service_name.strip():
            raise ValueError("otlp_service_name must not be empty")

    def _check_models(self) -> None:
        """`models` as entries (a string of NAME=PATH entries parsed, the models file read when `models` is
        empty), their names and aliases distinct, at most one default; `model` or these, not both."""
        models: Any = self.models
        if isinstance(models, str):
            models = parse_models(models, "models")
        elif not isinstance(models, tuple):  # a list (JSON) or another sequence of entries
            models = tuple(models)
        if self.models_file and not models:
            models = load_models_file(self.models_file)
        object.__setattr__(self, "models", models)
        if self.model and self.models:
            raise ValueError("model and models both set: give one model as model, or every model as models "
                             "(--model NAME=PATH, --models, --models-file)")
        if self.models and (self.served_model_name or self.model_alias):
            raise ValueError("served_model_name and model_alias name the one model of --model PATH; several models "
                             "are named by their entries (NAME=PATH, a models file's aliases)")
        seen: dict[str, str] = {}
        for entry in self.models:
            if not isinstance(entry, ModelEntry):
                raise ValueError(f"models must hold model entries; got {entry!r}")
            for name in entry.names:
                if name in seen:
                    raise ValueError(f"model name {name!r} is given twice (model {seen[name]!r} and "
                                     f"{entry.name or entry.path!r}): every name and alias must be distinct")
                seen[name] = entry.name or entry.path
        defaults = [entry.name or entry.path for entry in self.models if entry.default]
        if len(defaults) > 1:
            raise ValueError(f"more than one default model: {', '.join(map(repr, defaults))}; mark one")
        if self.model_control == "explicit" and self.edge_processes:
            raise ValueError("model_control explicit (loading and unloading models while serving) is for one process: "
                             "with edge_processes every edge holds the models it was started with")

    @property
    def model_entries(self) -> tuple[ModelEntry, ...]:
        """The models to serve, the default first: `models`, or the one `model` (its name from its manifest)."""
        if not self.models:
            return (ModelEntry("", self.model),) if self.model else ()
        default = next((entry for entry in self.models if entry.default), self.models[0])
        return (default, *(entry for entry in self.models if entry is not default))

    def for_model(self, entry: ModelEntry) -> ServiceConfig:
        """The config `entry`'s model runs with: this one, with its path as `model` and its settings over
        this one's (validated as any config is)."""
        return dataclasses.replace(self, model=entry.path, models=(), models_file="", served_model_name="",
                                   model_alias="", **dict(entry.settings))

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
                values[f.name] = flag_value
            elif env_value is not None:
                values[f.name] = [env_value] if f.metadata.get("repeat") else _parse(f, env_value)
        models = [parse_model(value, "model") for value in values.pop("model", []) if value]
        if len(models) == 1 and not models[0].name and "models" not in values:
            values["model"] = models[0].path  # the one-model form, as it always was
        elif models or "models" in values:
            values["models"] = (*models, *parse_models(values.get("models", ""), "models"))
        if values.get("models_file") and values.get("models"):
            raise ValueError("models_file and --model/--models (or ATTN_MODEL/ATTN_MODELS) both set: give the "
                             "models one way")
        if "model_alias" in values:  # repeated, each comma-separated
            values["model_alias"] = ",".join(values["model_alias"])
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


def parse_model(text: str, field_name: str) -> ModelEntry:
    """`NAME=PATH` (served as NAME), or a bare `PATH` (served by the bundle's own name). A `=` that follows a
    "/" is part of a path, not a name."""
    name, sep, path = text.partition("=")
    if sep and "/" not in name:
        if not NAME.fullmatch(name):
            raise ValueError(f"{field_name}: a model name is letters, digits and . _ : - before the '='; got "
                             f"{name!r} in {text!r}")
        return ModelEntry(name, path)
    return ModelEntry("", text)


def parse_models(text: str, field_name: str) -> tuple[ModelEntry, ...]:
    """Comma-separated `NAME=PATH` entries (each named: a comma list of bare paths would be ambiguous)."""
    entries = tuple(parse_model(part.strip(), field_name) for part in text.split(",") if part.strip())
    for entry in entries:
        if not entry.name:
            raise ValueError(f"{field_name}: every entry is NAME=PATH; got {entry.path!r}")
    return entries


_FILE_KEYS = ("path", "served_name", "aliases", "default")


def model_entry(key: str, table: Mapping[str, Any], base: Path | None = None, where: str = "") -> ModelEntry:
    """One model's table (of a models file, or `Engine.load_model`'s settings with "path"): checked key by key,
    the bad one named. A relative path is taken from `base` (the file's directory)."""
    where = where or f"model {key!r}"
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: must be a table of settings; got {table!r}")
    unknown = [k for k in table if k not in _FILE_KEYS and k not in MODEL_SETTINGS]
    if unknown:
        raise ValueError(f"{where}: unknown setting {unknown[0]!r}; one of {', '.join((*_FILE_KEYS, *MODEL_SETTINGS))}")
    path = table.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}.path: a bundle or Hugging Face folder is required; got {path!r}")
    if base is not None and not Path(path).is_absolute():
        path = str(base / path)
    name = table.get("served_name", key)
    if not isinstance(name, str):
        raise ValueError(f"{where}.served_name: must be a string; got {name!r}")
    aliases = table.get("aliases", [])
    if isinstance(aliases, str) or not isinstance(aliases, Sequence):
        raise ValueError(f"{where}.aliases: must be a list of names; got {aliases!r}")
    default = table.get("default", False)
    if not isinstance(default, bool):
        raise ValueError(f"{where}.default: must be true or false; got {default!r}")
    fields = {f.name: f for f in dataclasses.fields(ServiceConfig)}
    settings = []
    for setting in MODEL_SETTINGS:
        if setting in table:
            value, kind = table[setting], _kind(fields[setting])
            ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                article = "an" if kind is int else "a"
                raise ValueError(f"{where}.{setting}: must be {article} {kind.__name__}; got {value!r}")
            settings.append((setting, value))
    try:
        return ModelEntry(name, path, tuple(aliases), default, tuple(settings))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def load_models_file(path: str) -> tuple[ModelEntry, ...]:
    """A models file: one `[models.NAME]` table per model, in the order served (docs/configuration.md)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"models_file must name a readable file; got {path!r} ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"models_file {path!r} is not valid TOML: {e}") from None
    unknown = [k for k in data if k != "models"]
    if unknown:
        raise ValueError(f"models_file {path!r}: unknown key {unknown[0]!r}; the file holds [models.NAME] tables")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError(f"models_file {path!r}: no [models.NAME] table; it must name at least one model")
    base = Path(path).resolve().parent
    return tuple(model_entry(key, table, base, f"models_file {path!r}: models.{key}") for key, table in models.items())


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
