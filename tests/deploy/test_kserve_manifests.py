"""The KServe manifests (deploy/k8s/kserve): KServe's own CRD schemas, the pod KServe builds from them against
Kubernetes' schemas, and what neither schema sees.

- Schemas: the openAPIV3Schema of KServe's ClusterServingRuntime and InferenceService CRDs from a pinned release
  (tests/data/kserve/, with their source), checked as an API server with strict field validation does: unknown
  fields refused, int32/int64 ranges, list-map keys unique.
- The pod: KServe merges the runtime's container with the InferenceService's (strategic merge, args appended:
  pkg/controller/v1beta1/inferenceservice/utils/utils.go MergeRuntimeContainers, MergePodSpec) and mounts the
  storage initializer's volume; that pod validates against Kubernetes 1.27 and 1.37 strictly (kubernetes-validate).
- Beyond schemas: every ATTN_* variable and flag is a ServiceConfig setting and the merged set builds a valid
  ServiceConfig; declared ports and probes are ports the process listens on, with the right protocol (TLS: probes
  on the plaintext health port); KServe's and Knative's admission rules the examples rely on (one port in Knative
  mode, protocol versions, model formats, storage URIs, autoscaling); the drain fits the termination grace.
Each check is a function returning its problems, so the tests below can show a broken manifest refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from model.bundle import FORMAT_VERSION, TEXT_FORMAT_VERSION
from proto.attention.v1.codec import SERVICE_NAME
from service.config import ServiceConfig

REPO = Path(__file__).resolve().parents[2]
KSERVE_DIR = REPO / "deploy" / "k8s" / "kserve"
SCHEMA_DIR = REPO / "tests" / "data" / "kserve"
K8S_VERSIONS = ("1.27.0", "1.37.0")  # as tests/deploy/test_deploy.py

# KServe v0.20.0 facts the CRD schemas do not carry (the schema takes any string for these):
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}  # pkg/constants/constants.go, InferenceServiceProtocol
ISVC_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # inference_service_validation.go IsvcNameFmt
MODES = {"Standard", "Knative"}  # constants.go DeploymentModeType (RawDeployment/Serverless: the old names)
STORAGE_ROOT = "/mnt/models"  # constants.DefaultModelLocalMountPath
POD_LABELS = ("serving.kserve.io/inferenceservice", "component")  # on the predictor's pods (components/predictor.go)
BLOCKED_ENV = {"PYTHONPATH"}  # pkg/validation/env_policy.go DefaultBlockedEnvVars
GRPC_PORT_NAME = re.compile(r"grpc|h2c")  # service_reconciler.go isGrpcPort: appProtocol kubernetes.io/h2c
DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds default
# The fields of a predictor that are KServe's rather than the pod's (predictor.go PredictorSpec,
# component.go ComponentExtensionSpec); the rest is PodSpec, merged into the pod.
COMPONENT_FIELDS = {
    "model", "storageUris", "storageContainerName", "minReplicas", "maxReplicas", "scaleTarget", "scaleMetric",
    "scaleMetricType", "autoScaling", "containerConcurrency", "timeout", "canaryTrafficPercent", "logger",
    "batcher", "labels", "annotations", "deploymentStrategy",
}
# ModelSpec fields that are not the container's (predictor_model.go ModelSpec, predictor.go PredictorExtensionSpec).
MODEL_FIELDS = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage",
                "confidential"}
# Knative Serving v1.23.0 (pkg/apis/serving/k8s_validation.go, fieldmask.go, pkg/networking/constants.go): one
# port across the pod, named h2c, http1 or nothing (then 8080), not one of the queue-proxy's; no lifecycle hooks.
KNATIVE_PORT_NAMES = {"h2c", "http1", ""}
KNATIVE_DEFAULT_PORT = 8080
KNATIVE_RESERVED_PORTS = {8008, 8012, 8013, 8022, 9090, 9091}
KNATIVE_VOLUME_SOURCES = {"secret", "configMap", "projected", "emptyDir"}  # emptyDir: on by default


# --- the manifests --------------------------------------------------------------------------------------


def kserve_documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(KSERVE_DIR.rglob("*.yaml")):
        with path.open() as f:
            docs += [(path, doc) for doc in yaml.safe_load_all(f) if doc and doc["kind"] != "Kustomization"]
    return docs


def the_runtime() -> dict[str, Any]:
    (runtime,) = [d for _, d in kserve_documents() if d["kind"] == "ClusterServingRuntime"]
    return runtime


def inference_services() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in kserve_documents() if d["kind"] == "InferenceService"]


def core_documents() -> list[tuple[Path, dict[str, Any]]]:
    """The Kubernetes objects that come with an example (not KServe's kinds)."""
    return [(p, d) for p, d in kserve_documents() if not d["apiVersion"].startswith("serving.kserve.io/")]


ISVCS = inference_services()
ISVC_IDS = [p.name for p, _ in ISVCS]


def example(name: str) -> dict[str, Any]:
    (found,) = [d for p, d in ISVCS if p.name == name]
    return found


# --- KServe's CRD schemas, checked as an API server does ------------------------------------------------


def crd_record(kind: str) -> dict[str, Any]:
    records: list[dict[str, Any]] = [json.loads(p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.json"))]
    (found,) = [r for r in records if r.get("kind") == kind]
    return found


def _strict(node: Any) -> Any:
    """Unknown fields refused where the schema lists the fields (Kubernetes' fieldValidation=Strict, what
    kubectl asks for by default), unless it preserves unknown fields."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in node and "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _list_type(validator: Any, list_type: str, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    """x-kubernetes-list-type: a `set` holds no item twice, a `map` no two items with the same keys (missing
    keys take their default, as the API server defaults them before it checks)."""
    if not isinstance(instance, list):
        return
    if list_type == "set":
        keys = [json.dumps(item, sort_keys=True) for item in instance]
    elif list_type == "map":
        props = schema.get("items", {}).get("properties", {})
        keys = [json.dumps([item.get(k, props.get(k, {}).get("default")) for k in schema["x-kubernetes-list-map-keys"]])
                for item in instance if isinstance(item, dict)]
    else:
        return
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        yield jsonschema.ValidationError(f"duplicate entries for x-kubernetes-list-type {list_type}: {duplicates}")


FORMATS = jsonschema.FormatChecker()
for _bits in (32, 64):
    FORMATS.checks(f"int{_bits}")(lambda v, b=_bits: not isinstance(v, int) or -(2 ** (b - 1)) <= v < 2 ** (b - 1))


CRDValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})


def schema_problems(doc: dict[str, Any]) -> list[str]:
    """The document against its kind's pinned KServe CRD schema (and its apiVersion against the CRD's)."""
    record = crd_record(doc["kind"])
    expected = f"{record['group']}/{record['version']}"
    if doc.get("apiVersion") != expected:
        return [f"apiVersion {doc.get('apiVersion')!r}: KServe {record['source']['tag']} serves {expected}"]
    validator = CRDValidator(_strict(record["openAPIV3Schema"]), format_checker=FORMATS)
    problems = []
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(map(str, error.absolute_path)) or "(root)"
        hint = ""
        if error.validator == "additionalProperties" and any(
                f"'{path.rsplit('.', 1)[-1]}'" in error.message for path in record["dropped"]):
            hint = " (left out of the committed schema: tests/data/kserve/README.md)"
        problems.append(f"{where}: {error.message}{hint}")
    return problems


def metadata_problems(doc: dict[str, Any], version: str) -> list[str]:
    """A CRD schema says only `metadata: object`; the API server checks it as ObjectMeta. So does this, on a
    ConfigMap carrying the same metadata."""
    import kubernetes_validate

    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    try:
        kubernetes_validate.validate(carrier, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"metadata: {exc}"]
    return []


# --- the pod KServe builds ------------------------------------------------------------------------------


def _merge(base: Any, over: Any, keys: dict[str, str]) -> Any:
    """Strategic merge of the container fields these manifests use: maps merge deeply, lists of the keyed
    kinds merge by their key (env by name, ports by containerPort, volumeMounts by mountPath), other lists
    and scalars are replaced."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return copy.deepcopy(over)
    merged = dict(base)
    for k, v in over.items():
        merged[k] = _merge_list(base.get(k), v, keys[k]) if k in keys else _merge(base.get(k), v, keys)
    return merged


def _merge_list(base: list[dict[str, Any]] | None, over: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    merged = {item[key]: item for item in base or []}
    for item in over:
        merged[item[key]] = _merge(merged.get(item[key]), item, {})
    return list(merged.values())


CONTAINER_KEYS = {"env": "name", "ports": "containerPort", "volumeMounts": "mountPath"}


def predictor_container(isvc: dict[str, Any] | None, runtime: dict[str, Any]) -> dict[str, Any]:
    """kserve-container as KServe runs it: the runtime's, merged with the InferenceService's model container,
    the runtime's args first."""
    (base,) = runtime["spec"]["containers"]
    model = {k: v for k, v in ((isvc or {}).get("spec", {}).get("predictor", {}).get("model") or {}).items()
             if k not in MODEL_FIELDS}
    merged: dict[str, Any] = _merge(base, {k: v for k, v in model.items() if k != "args"}, CONTAINER_KEYS)
    args = [*base.get("args", []), *model.get("args", [])]
    if args:
        merged["args"] = args
    mounts = storage_mounts(isvc)
    if mounts:
        # The storage initializer's volume, at the common parent of the model paths (pkg/utils/storage.go).
        merged["volumeMounts"] = [*merged.get("volumeMounts", []),
                                  {"name": "kserve-provision-location", "mountPath": posixpath.commonpath(mounts),
                                   "readOnly": True}]
    return merged


def storage_mounts(isvc: dict[str, Any] | None) -> list[str]:
    predictor = (isvc or {}).get("spec", {}).get("predictor", {})
    if predictor.get("storageUris"):
        return [u.get("mountPath", STORAGE_ROOT) for u in predictor["storageUris"]]
    return [STORAGE_ROOT] if (predictor.get("model") or {}).get("storageUri") else []


def predictor_pod(isvc: dict[str, Any] | None, runtime: dict[str, Any]) -> dict[str, Any]:
    predictor = (isvc or {}).get("spec", {}).get("predictor", {})
    pod_fields = {k: v for k, v in predictor.items() if k not in COMPONENT_FIELDS}
    volumes = _merge_list(runtime["spec"].get("volumes", []), pod_fields.pop("volumes", []), "name")
    if storage_mounts(isvc):
        volumes.append({"name": "kserve-provision-location", "emptyDir": {}})
    annotations = {**runtime["spec"].get("annotations", {}), **predictor.get("annotations", {})}
    name = (isvc or runtime)["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-predictor", "annotations": annotations},
            "spec": {**pod_fields, "containers": [predictor_container(isvc, runtime)], "volumes": volumes}}


# --- what the process makes of it -----------------------------------------------------------------------

SETTINGS = {f.name: f for f in dataclasses.fields(ServiceConfig)}
FLAGS = {"--" + name.replace("_", "-") for name, f in SETTINGS.items() if f.metadata.get("flag", True)}
FILE_SETTINGS = ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file")


def _flags(args: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) for each --flag in args (the value of `--flag=v`, or the next item if it is no flag)."""
    out: list[tuple[str, str | None]] = []
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            following = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            out.append((flag, value if eq else following))
    return out


def setting_problems(container: dict[str, Any]) -> list[str]:
    problems = []
    for entry in container.get("env", []):
        name = entry["name"]  # other names are the libraries' (CUDA_CACHE_PATH on a GPU, as deploy/k8s/gpu)
        if name.startswith("ATTN_") and name.removeprefix("ATTN_").lower() not in SETTINGS:
            problems.append(f"env {name}: not a ServiceConfig setting (python -m service --help)")
        elif name.startswith("ATTN_") and "value" not in entry:
            problems.append(f"env {name}: a literal value expected (secrets come as files)")
        if name in BLOCKED_ENV:
            problems.append(f"env {name}: refused by KServe's webhook")
    for flag, _ in _flags(container.get("args", [])):
        if flag not in FLAGS:
            problems.append(f"arg {flag}: not a flag of python -m service")
    return problems


def service_config(pod: dict[str, Any], tmp_path: Path) -> ServiceConfig:
    """The ServiceConfig the container's env and args make; files from Secrets stand in as empty files here
    (secret_file_problems checks they come from a mounted Secret)."""
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    for setting in FILE_SETTINGS:
        if env.get(f"ATTN_{setting.upper()}"):
            stand_in = tmp_path / setting
            stand_in.write_text("stand-in\n")
            env[f"ATTN_{setting.upper()}"] = str(stand_in)
    return ServiceConfig.from_args(container.get("args", []), env)


def secret_file_problems(pod: dict[str, Any]) -> list[str]:
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    secrets = {v["name"] for v in pod["spec"]["volumes"] if "secret" in v}
    mounted = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    problems = []
    for setting in FILE_SETTINGS:
        path = env.get(f"ATTN_{setting.upper()}")
        if path and mounted.get(posixpath.dirname(path)) not in secrets:
            problems.append(f"ATTN_{setting.upper()}={path}: not a file of a mounted Secret volume")
    return problems


def model_problems(pod: dict[str, Any], config: ServiceConfig, isvc: dict[str, Any] | None) -> list[str]:
    """The model the process loads is what the storage initializer put under /mnt/models: ATTN_MODEL, or each
    `--model NAME=PATH` (the multi-model form; flags win over ATTN_MODEL)."""
    (container,) = pod["spec"]["containers"]
    named = [v or "" for f, v in _flags(container.get("args", [])) if f == "--model"]
    if not named:
        paths = [config.model]
    else:
        pairs = [v.partition("=") for v in named]
        names = [n for n, eq, _ in pairs if eq]
        if len(names) != len(named) or len(set(names)) != len(names):
            return [f"--model {named}: the multi-model form is NAME=PATH, each name once"]
        paths = [p for _, _, p in pairs]
    if isvc is None:
        return [] if paths == [STORAGE_ROOT] else [f"runtime: the model is {paths}, not {STORAGE_ROOT}"]
    mounts = storage_mounts(isvc)
    return [f"model path {p}: no storage URI is downloaded there ({mounts})" for p in paths if p not in mounts]


def listening_ports(config: ServiceConfig) -> dict[str, int]:
    ports = {"grpc": config.port, "http": config.http_port, "metrics": config.metrics_port,
             "health": config.health_port}
    return {door: port for door, port in ports.items() if port > 0}


def port_problems(pod: dict[str, Any], config: ServiceConfig) -> list[str]:
    """Declared ports are the ones the process listens on, named for their protocol; probes go to listening
    ports (and declared ones, where any are declared) with the right health name; with TLS the kubelet's gRPC
    probe (no TLS) must use the plaintext health port; the scrape annotations name the metrics port."""
    problems = []
    listening = listening_ports(config)
    door_of = {port: door for door, port in listening.items()}
    if 0 in (config.port, config.http_port, config.metrics_port, config.health_port):
        problems.append("a port set to 0 (a random one) cannot be declared or probed")
    (container,) = pod["spec"]["containers"]
    declared = {p["containerPort"]: p.get("name", "") for p in container.get("ports", [])}
    for port, name in declared.items():
        door = door_of.get(port)
        if door is None:
            problems.append(f"port {name} {port}: the process does not listen there ({listening})")
        elif door == "http" and GRPC_PORT_NAME.search(name):
            problems.append(f"port {name} {port}: the HTTP door speaks HTTP/1.1, not h2c")
        elif door == "grpc" and (name == "http1" or (config.tls and GRPC_PORT_NAME.search(name))):
            problems.append(f"port {name} {port}: the gRPC port is {'TLS' if config.tls else 'h2c'}")
    plaintext_grpc = {listening["health"]} if "health" in listening else set()
    if not config.tls:
        plaintext_grpc.add(config.port)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if probe is None:
            problems.append(f"{kind}: missing")
            continue
        if "grpc" in probe:
            port, service = probe["grpc"]["port"], probe["grpc"].get("service", "")
            if port not in plaintext_grpc:
                problems.append(f"{kind}: grpc port {port} is not a plaintext gRPC port ({sorted(plaintext_grpc)})")
            want = "" if kind == "livenessProbe" else SERVICE_NAME
            if service != want:
                problems.append(f"{kind}: health service {service!r}, expected {want!r}")
        elif "httpGet" in probe:
            port = probe["httpGet"]["port"]
            if port != config.http_port or probe["httpGet"].get("path") not in health_paths():
                problems.append(f"{kind}: httpGet {port}{probe['httpGet'].get('path')} is no health route")
            if (probe["httpGet"].get("scheme", "HTTP") == "HTTPS") != config.tls:
                problems.append(f"{kind}: scheme must be HTTPS exactly when TLS is on")
        else:
            problems.append(f"{kind}: gRPC or httpGet expected")
            continue
        if declared and port not in declared:
            problems.append(f"{kind}: port {port} is not declared ({sorted(declared)})")
    annotations = pod["metadata"]["annotations"]
    for key in ("prometheus.io/port", "prometheus.kserve.io/port"):
        if annotations.get(key) != str(config.metrics_port):
            problems.append(f"annotation {key}={annotations.get(key)!r}, the metrics port is {config.metrics_port}")
    for key in ("prometheus.io/path", "prometheus.kserve.io/path"):
        if annotations.get(key) != "/metrics":
            problems.append(f"annotation {key}={annotations.get(key)!r}")
    if annotations.get("prometheus.io/scrape") != "true":
        problems.append("annotation prometheus.io/scrape is not \"true\"")
    return problems


def drain_problems(pod: dict[str, Any], config: ServiceConfig) -> list[str]:
    """No preStop hook (Knative refuses one), so the grace covers the drain delay, the drain grace and a margin."""
    grace = pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    need = config.drain_delay_s + config.drain_grace_s + 2
    return [] if grace >= need else [f"terminationGracePeriodSeconds {grace} < drain {need} s"]


# --- KServe's and Knative's admission rules -------------------------------------------------------------


def runtime_problems(runtime: dict[str, Any], kserve_runtimes: dict[str, Any]) -> list[str]:
    spec = runtime["spec"]
    problems = []
    if [c["name"] for c in spec["containers"]] != ["kserve-container"]:
        problems.append("one container, named kserve-container (the one KServe merges the model into)")
    protocols = spec.get("protocolVersions", [])
    if set(protocols) - PROTOCOLS:
        problems.append(f"protocolVersions {sorted(set(protocols) - PROTOCOLS)} unknown to KServe {sorted(PROTOCOLS)}")
    if not {"v2", "grpc-v2"} <= set(protocols):
        problems.append(f"protocolVersions {protocols}: the service speaks v2 and grpc-v2")
    if any(c.get("ports") for c in spec["containers"]):
        problems.append("ports declared in the runtime: KServe merges them into every InferenceService, and "
                        "Knative allows one")
    if any(c.get("lifecycle") for c in spec["containers"]):
        problems.append("lifecycle hooks: Knative refuses them")
    formats = spec.get("supportedModelFormats", [])
    bundles = {f.get("version") for f in formats if f["name"] == "attention-bundle"}
    if bundles != {str(FORMAT_VERSION), str(TEXT_FORMAT_VERSION)}:
        problems.append(f"attention-bundle versions {bundles}: model/bundle.py reads "
                        f"{FORMAT_VERSION} and {TEXT_FORMAT_VERSION}")
    # servingruntime_webhook.go: one priority per auto-selected format, and none shared with an installed
    # runtime that auto-selects the same format and version over a common protocol (KServe installs its own).
    chosen = [f for f in formats if f.get("autoSelect")]
    for f in chosen:
        if len({g.get("priority") for g in chosen if g["name"] == f["name"]}) > 1:
            problems.append(f"format {f['name']}: different priorities in one runtime")
        for name, other in kserve_runtimes.items():
            if not set(other["protocolVersions"]) & set(protocols):
                continue
            for g in other["supportedModelFormats"]:
                same = g["name"].lower() == f["name"].lower() and g.get("version") == f.get("version")
                if same and g.get("autoSelect") and g.get("priority") is not None and g.get("priority") == f.get(
                        "priority"):
                    problems.append(f"format {f['name']} {f.get('version')}: priority {f.get('priority')} "
                                    f"taken by KServe's {name}")
    return problems


def mode_of(isvc: dict[str, Any]) -> str | None:
    mode: str | None = isvc["metadata"].get("annotations", {}).get("serving.kserve.io/deploymentMode")
    return mode


def isvc_problems(isvc: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    meta, predictor = isvc["metadata"], isvc["spec"]["predictor"]
    model = predictor.get("model") or {}
    annotations = meta.get("annotations", {})
    problems = []
    if not ISVC_NAME.fullmatch(meta["name"]):
        problems.append(f"name {meta['name']!r} does not match {ISVC_NAME.pattern}")
    mode = mode_of(isvc)
    if mode not in MODES:
        problems.append(f"deploymentMode {mode!r}: say which of {sorted(MODES)} (the cluster default varies)")
    if model.get("runtime") != runtime["metadata"]["name"]:
        problems.append(f"runtime {model.get('runtime')!r}, expected {runtime['metadata']['name']!r}")
    if "name" in model:
        problems.append("model.name: refused by KServe's webhook")
    protocol = model.get("protocolVersion")
    if protocol not in runtime["spec"].get("protocolVersions", []):
        problems.append(f"protocolVersion {protocol!r} not in the runtime's {runtime['spec'].get('protocolVersions')}")
    fmt = model.get("modelFormat", {})
    if not any(f["name"] == fmt.get("name") and f.get("version") == fmt.get("version")
               for f in runtime["spec"].get("supportedModelFormats", [])):
        problems.append(f"modelFormat {fmt} not supported by the runtime")
    uris = predictor.get("storageUris")
    if bool(uris) == bool(model.get("storageUri") or model.get("storage")):
        problems.append("exactly one of model.storageUri and predictor.storageUris")
    if uris:
        paths = [u.get("mountPath", STORAGE_ROOT) for u in uris]
        for path in paths:
            if not path.startswith("/") or ".." in path or path == "/":
                problems.append(f"storageUris mountPath {path!r}: absolute, without '..'")
        if len(paths) > 1 and posixpath.commonpath(paths) == "/":
            problems.append(f"storageUris mountPaths {paths}: no common parent")
    container = predictor_container(isvc, runtime)
    ports = container.get("ports", [])
    if mode == "Knative":
        # The one port Knative routes: the one declared, or 8080 (the HTTP door) when none is.
        if len(ports) > 1:
            problems.append(f"Knative mode: {len(ports)} ports; Knative routes one (h2c gRPC or http1 HTTP)")
        for port in ports[:1]:
            if port.get("name", "") not in KNATIVE_PORT_NAMES or port["containerPort"] in KNATIVE_RESERVED_PORTS:
                problems.append(f"Knative mode: port {port} (name h2c/http1, not a queue-proxy port)")
        if container.get("lifecycle") or predictor.get("securityContext"):
            problems.append("Knative mode: no lifecycle hooks and no pod securityContext")
        pod = predictor_pod(isvc, runtime)
        for volume in pod["spec"]["volumes"]:
            if not set(volume) - {"name"} <= KNATIVE_VOLUME_SOURCES:
                problems.append(f"Knative mode: volume {volume['name']} of a kind Knative refuses by default")
        metric = predictor.get("scaleMetric", "concurrency")
        if metric not in {"concurrency", "rps"} or "deploymentStrategy" in predictor:
            problems.append("Knative mode: scaleMetric concurrency or rps, no deploymentStrategy")
    elif mode == "Standard":
        names = [p.get("name") for p in ports]
        if len(set(names)) != len(names) or None in names:
            problems.append(f"Standard mode: port names {names} (they name the Service's ports)")
        if annotations.get("serving.kserve.io/autoscalerClass", "hpa") == "hpa":
            if predictor.get("scaleMetric", "cpu") not in {"cpu", "memory"}:
                problems.append(f"HPA: scaleMetric {predictor.get('scaleMetric')!r}")
            for metric in predictor.get("autoScaling", {}).get("metrics", []):
                target = (metric.get("resource") or {}).get("target", {})
                if metric["type"] != "Resource" or (
                        target.get("type") == "Utilization" and not 1 <= target.get("averageUtilization", 0) <= 100):
                    problems.append(f"HPA: metric {metric} (Resource, utilization 1-100)")
    return problems


def pod_problems(pod: dict[str, Any], isvc: dict[str, Any] | None, tmp_path: Path) -> list[str]:
    """Everything the process makes of the pod; [] or the reasons it would not start or not be reachable."""
    (container,) = pod["spec"]["containers"]
    problems = setting_problems(container) + secret_file_problems(pod)
    if problems:
        return problems
    try:
        config = service_config(pod, tmp_path)
    except ValueError as exc:
        return [f"ServiceConfig refuses it: {exc}"]
    except SystemExit:  # argparse, on a bad choice or a missing value (it prints why)
        return [f"ServiceConfig refuses it: python -m service {' '.join(container.get('args', []))} exits"]
    problems += model_problems(pod, config, isvc) + port_problems(pod, config) + drain_problems(pod, config)
    if isvc is not None and mode_of(isvc) == "Knative":
        served = container.get("ports") or [{"containerPort": KNATIVE_DEFAULT_PORT, "name": "http1"}]
        door = {p: d for d, p in listening_ports(config).items()}.get(served[0]["containerPort"])
        if door not in ("grpc", "http"):
            problems.append(f"Knative routes port {served[0]['containerPort']}: no door listens there")
    return problems


@pytest.fixture(scope="module")
def kserve_runtimes() -> dict[str, Any]:
    runtimes: dict[str, Any] = json.loads((SCHEMA_DIR / "runtimes.v0.20.0.json").read_text())["runtimes"]
    return runtimes


# --- the tests ------------------------------------------------------------------------------------------


def test_the_schemas_are_the_pinned_release() -> None:
    records = [json.loads(p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.json"))]
    assert {r["source"]["tag"] for r in records} == {"v0.20.0"}
    assert {r["source"]["commit"] for r in records} == {"1fb781055dd1567164358233e1125142ca6ef1fe"}
    readme = (SCHEMA_DIR / "README.md").read_text()
    for record in records:
        if "sha256" in record["source"]:
            assert record["source"]["sha256"] in readme, f"{record['kind']}: README does not record its source"


def test_every_manifest_validates_against_kserves_crd_schema() -> None:
    kinds = set()
    core = [d for _, d in core_documents()]
    for path, doc in [(p, d) for p, d in kserve_documents() if d not in core]:
        problems = schema_problems(doc)
        assert not problems, f"{path.relative_to(REPO)}: " + "; ".join(problems)
        kinds.add(doc["kind"])
    assert kinds == {"ClusterServingRuntime", "InferenceService"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_metadata_and_the_pods_validate_against_kubernetes(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    runtime = the_runtime()
    pods = [("the runtime alone", predictor_pod(None, runtime))]
    pods += [(path.name, predictor_pod(isvc, runtime)) for path, isvc in ISVCS]
    for _, doc in kserve_documents():
        assert not metadata_problems(doc, version), metadata_problems(doc, version)
    for path, doc in core_documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: {exc}")
    for where, pod in pods:
        try:
            kubernetes_validate.validate(pod, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            pytest.fail(f"{where}: the pod KServe builds, on Kubernetes {version}: {exc}")


def test_the_runtime(kserve_runtimes: dict[str, Any], tmp_path: Path) -> None:
    runtime = the_runtime()
    assert not runtime_problems(runtime, kserve_runtimes), runtime_problems(runtime, kserve_runtimes)
    problems = pod_problems(predictor_pod(None, runtime), None, tmp_path)
    assert not problems, problems


@pytest.mark.parametrize(("path", "isvc"), ISVCS, ids=ISVC_IDS)
def test_each_inference_service(path: Path, isvc: dict[str, Any], tmp_path: Path) -> None:
    runtime = the_runtime()
    problems = isvc_problems(isvc, runtime) + pod_problems(predictor_pod(isvc, runtime), isvc, tmp_path)
    assert not problems, f"{path.relative_to(REPO)}: " + "; ".join(problems)


def test_the_examples_cover_both_modes_and_both_forms(tmp_path: Path) -> None:
    """One embedder; an embedder and a reranker in one process (`--model NAME=PATH` repeated); Knative and
    Standard; gRPC through Knative's one port; TLS with probes on the health port; tokens everywhere."""
    runtime = the_runtime()
    seen = set()
    for _, isvc in ISVCS:
        pod = predictor_pod(isvc, runtime)
        config = service_config(pod, tmp_path)
        (container,) = pod["spec"]["containers"]
        models = [v for f, v in _flags(container.get("args", [])) if f == "--model"]
        seen.add(str(mode_of(isvc)))
        seen.add(f"models={len(models) or 1}")
        seen |= {"tls"} if config.tls else set()
        assert config.auth_tokens_file, "tokens come from the runtime's Secret"
        if mode_of(isvc) == "Knative":
            assert [p["name"] for p in container["ports"]] == ["h2c"]
    assert {"Knative", "Standard", "models=1", "models=2", "tls"} <= seen, seen


def test_kustomization_and_layout() -> None:
    """The kustomization installs the runtime; the InferenceServices (per namespace) and what comes with them
    live in examples/."""
    listed = yaml.safe_load((KSERVE_DIR / "kustomization.yaml").read_text())["resources"]
    assert listed == ["clusterservingruntime.yaml"]
    for path, doc in kserve_documents():
        where = path.relative_to(KSERVE_DIR)
        assert (doc["kind"] != "ClusterServingRuntime") == (where.parts[0] == "examples"), where


def test_the_disruption_budgets_select_their_predictor() -> None:
    """A PodDisruptionBudget beside an InferenceService selects that InferenceService's predictor pods."""
    budgets = [(p, d) for p, d in core_documents() if d["kind"] == "PodDisruptionBudget"]
    assert budgets, "the Standard-mode example has one"
    for path, pdb in budgets:
        ((_, isvc),) = [(p, d) for p, d in ISVCS if p == path]
        labels = dict(zip(POD_LABELS, (isvc["metadata"]["name"], "predictor"), strict=True))
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), (path.name, labels)
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"]), "one of min/max"
        assert (isvc["spec"]["predictor"].get("minReplicas") or 1) > pdb["spec"].get("maxUnavailable", 0)


# --- and they can fail ----------------------------------------------------------------------------------


def _broken(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of doc with the value at a dotted path (list indexes as numbers) set, or deleted for ...."""
    out = copy.deepcopy(doc)
    *parents, last = [int(p) if p.isdigit() else p for p in dotted.split(".")]
    node: Any = out
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return out


def test_the_pod_check_refuses_a_broken_pod() -> None:
    """The merge leaves no KServe field in the pod (COMPONENT_FIELDS), and Kubernetes' schema catches what does."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -r requirements-dev.txt")
    pod = predictor_pod(example("embedder-reranker.yaml"), the_runtime())
    kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=True)
    for dotted, value in (("spec.minReplicas", 2), ("spec.containers.0.ports.0.containerPort", "https")):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(_broken(pod, dotted, value), K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(("kind", "dotted", "value", "message"), [
    ("ClusterServingRuntime", "spec.protocolVersion", ["v2"], "Additional properties are not allowed"),
    ("ClusterServingRuntime", "spec.supportedModelFormats", "attention-bundle", "is not of type 'array'"),
    ("ClusterServingRuntime", "spec.supportedModelFormats.0.priority", 0, "less than the minimum of 1"),
    ("ClusterServingRuntime", "apiVersion", "serving.kserve.io/v1beta1", "serves serving.kserve.io/v1alpha1"),
    ("InferenceService", "spec.predictor.minReplicas", "two", "is not of type 'integer'"),
    ("InferenceService", "spec.predictor.maxReplicas", 2**40, "is not a 'int32'"),
    ("InferenceService", "spec.predictor.scaleMetric", "queue", "is not one of"),
    ("InferenceService", "spec.predictor.model.ports.1", {"name": "again", "containerPort": 8080}, "duplicate"),
    ("InferenceService", "spec.transformer", {"containers": []}, "left out of the committed schema"),
    ("InferenceService", "spec.predictor", ..., "'predictor' is a required property"),
])
def test_the_schemas_refuse_a_broken_manifest(kind: str, dotted: str, value: Any, message: str) -> None:
    doc = the_runtime() if kind == "ClusterServingRuntime" else example("embedder-reranker.yaml")
    assert not schema_problems(doc)
    problems = schema_problems(_broken(doc, dotted, value))
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(("dotted", "value", "message"), [
    ("spec.protocolVersions", ["v2", "grpc-v3"], "unknown to KServe"),
    ("spec.protocolVersions", ["v2"], "speaks v2 and grpc-v2"),
    ("spec.supportedModelFormats.0.version", "3", "model/bundle.py reads"),
    ("spec.supportedModelFormats.2", {"name": "huggingface", "version": "1", "autoSelect": True, "priority": 1},
     "taken by KServe's kserve-huggingfaceserver"),
    ("spec.containers.0.ports", [{"name": "h2c", "containerPort": 8081}], "Knative allows one"),
    ("spec.containers.0.name", "server", "named kserve-container"),
])
def test_the_runtime_checks_refuse_a_broken_runtime(kserve_runtimes: dict[str, Any], dotted: str, value: Any,
                                                    message: str) -> None:
    problems = runtime_problems(_broken(the_runtime(), dotted, value), kserve_runtimes)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(("name", "dotted", "value", "message"), [
    ("embedder.yaml", "spec.predictor.model.env", [{"name": "ATTN_HTTPPORT", "value": "8080"}], "not a ServiceConfig"),
    ("embedder.yaml", "spec.predictor.model.args", ["--http_port", "8080"], "not a flag"),
    ("embedder.yaml", "spec.predictor.model.env", [{"name": "ATTN_DEVICE", "value": "tpu"}], "ServiceConfig refuses"),
    ("embedder.yaml", "spec.predictor.model.ports", [{"name": "h2c", "containerPort": 8082}], "does not listen"),
    ("embedder.yaml", "spec.predictor.model.ports", [{"name": "h2c", "containerPort": 8080}], "speaks HTTP/1.1"),
    ("embedder.yaml", "spec.predictor.model.ports",
     [{"name": "h2c", "containerPort": 8081}, {"name": "http1", "containerPort": 8080}], "Knative routes one"),
    ("embedder.yaml", "spec.predictor.model.readinessProbe", {"grpc": {"port": 9464}}, "not a plaintext gRPC"),
    ("embedder.yaml", "spec.predictor.model.livenessProbe", {"grpc": {"service": SERVICE_NAME}}, "expected ''"),
    ("embedder.yaml", "spec.predictor.model.protocolVersion", "v1", "not in the runtime's"),
    ("embedder.yaml", "spec.predictor.model.modelFormat", {"name": "onnx", "version": "1"}, "not supported"),
    ("embedder.yaml", "spec.predictor.terminationGracePeriodSeconds", 10, "< drain"),
    ("embedder.yaml", "metadata.annotations", {}, "deploymentMode None"),
    ("embedder.yaml", "metadata.name", "Embedder", "does not match"),
    ("embedder.yaml", "spec.predictor.storageUris", ..., "exactly one of model.storageUri and predictor.storageUris"),
    ("embedder-reranker.yaml", "spec.predictor.model.readinessProbe", {"grpc": {"port": 8081}}, "plaintext gRPC"),
    ("embedder-reranker.yaml", "spec.predictor.model.ports.1.name", "grpc", "the gRPC port is TLS"),
    ("embedder-reranker.yaml", "spec.predictor.model.args.1", "/mnt/models/embedder", "NAME=PATH"),
    ("embedder-reranker.yaml", "spec.predictor.model.args.3", "reranker=/mnt/models/rerank", "no storage URI"),
    ("embedder-reranker.yaml", "spec.predictor.storageUris.1.mountPath", "/srv/reranker", "no common parent"),
    ("embedder-reranker.yaml", "spec.predictor.model.volumeMounts", [], "not a file of a mounted Secret"),
    ("embedder-reranker.yaml", "spec.predictor.autoScaling.metrics.0.resource.target.averageUtilization", 170,
     "utilization 1-100"),
])
def test_the_checks_refuse_a_broken_inference_service(name: str, dotted: str, value: Any, message: str,
                                                      tmp_path: Path) -> None:
    isvc, runtime = example(name), the_runtime()
    broken = _broken(isvc, dotted, value)
    problems = isvc_problems(broken, runtime) + pod_problems(predictor_pod(broken, runtime), broken, tmp_path)
    assert any(message in p for p in problems), problems


def health_paths() -> set[str]:
    """The HTTP door's health routes, as its dialects declare them."""
    from prometheus_client import CollectorRegistry

    from service.config import ServiceConfig
    from service.doors.build import http_dialects
    from service.doors.calls import Calls, Serving
    from service.doors.kserve.core import KServe
    from service.metrics import Metrics

    calls = Calls(ServiceConfig(), Serving(), Metrics(CollectorRegistry()))
    return {r.path for d in http_dialects(calls, KServe(calls)) for r in d.routes if r.health}
