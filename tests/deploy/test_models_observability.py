"""Several models in one service as an operator sees them (issue 41, "What must show"): a real `python -m service`
serving an embedder and a reranker (`--model embed=BUNDLE --model rerank=HF_FOLDER`, as
docker-compose.models.yml does), called on each model, scraped every second by a real Prometheus (the Debian
binary, tests/support/prometheus_server.py), then:

- every metric family with a `model` label has series for both models in Prometheus, and the scraped request
  counts per model and method equal the calls this test made;
- every query of the shipped Grafana dashboard, its variables substituted as Grafana does (`$model` each model
  in turn, and All), returns data for each model on every per-model panel, and a panel that draws one line per
  model (`{{model}}` in its legend) draws only the chosen model's;
- each front door counts a call under the model it ran on (the server's /metrics).

Loopback only; every load loop is bounded in rounds and in time, and waits on Prometheus, never on a sleep.
"""

from __future__ import annotations

import collections
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import yaml

from proto.attention.v1 import attention_pb2 as pb
from proto.attention.v1 import attention_pb2_grpc
from service.metrics import metric_families
from tests.support.prometheus_server import PrometheusServer, Sample, is_one, prometheus_server
from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "attention.json"
DATASOURCE = REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
EMBED, RERANK = "embed", "rerank"  # the served names; EMBED is the default model (the first --model)
MODELS = (EMBED, RERANK)
JOB = "attention"  # the job name the dashboard's queries select, as in deploy/prometheus/prometheus.yml
TEXTS = ["a cat sat", "the dog ran far", "b c"]
QUERY = "a cat"
# Bounds of the load that runs until the dashboard shows every model: rounds (one per scrape) and seconds.
MAX_ROUNDS, MAX_SECONDS = 60, 120.0

# Families with a `model` label that a healthy service under light load does not export, and why.
FAMILIES_NOT_EXPECTED = {
    "attention_batch_splits_total": "only once a batch has been split (an OOM or a model error)",
    "attention_warmup_forward_seconds": "only when warm-up measures the precision; this server pins fp32 "
                                        "(tests/support/server_process.py PINNED)",
    "attention_warmup_tokens_per_second": "only when warm-up measures the batch budget; this server pins it",
}
# Dashboard panels left out of the per-model check, by title prefix, and why.
PANELS_NOT_EXPECTED = {
    "Envoy:": "Envoy's own series (job envoy) exist only behind docker-compose.scale.yml or deploy/k8s",
}


# --- the service and Prometheus --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_models(tiny_text_bundle: Path, bert_reranker: Any,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The service with an embedder (a text bundle) and a reranker given as a Hugging Face folder, converted
    into --cache-dir at start-up as the compose example's is. Every batch is sampled for attention health
    and a baseline is set, so the dashboard's attention-health panels have data too."""
    directory = tmp_path_factory.mktemp("two-models")
    # ServerProcess passes its bundle as the first --model: NAME=PATH there makes it the first named model.
    server = ServerProcess(Path(f"{EMBED}={tiny_text_bundle}"), "--model", f"{RERANK}={bert_reranker[1]}",
                           "--cache-dir", str(directory / "cache"), "--diagnostics-sample", "1",
                           "--entropy-baseline", "0.5", directory=directory / "server")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prom(two_models: ServerProcess) -> Iterator[PrometheusServer]:
    with prometheus_server([f"127.0.0.1:{two_models.ports['metrics_port']}"], job=JOB) as server:
        server.wait_for(f'up{{job="{JOB}"}}', is_one, timeout=60)
        yield server


class Caller:
    """Calls to each model, counted by (method label, model) as the service should count them: attention.v1
    Encode on the embedder, Rerank on the reranker, and the HTTP door's /v1/encode on both."""

    def __init__(self, server: ServerProcess) -> None:
        self.channel = grpc.insecure_channel(server.target)
        self.stub = attention_pb2_grpc.AttentionServiceStub(self.channel)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{server.ports['http_port']}", timeout=30,
                                 trust_env=False)
        self.sent: collections.Counter[tuple[str, str]] = collections.Counter()

    def round(self) -> None:
        self.stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in TEXTS], model=EMBED,
                                          output=pb.OutputOptions(pooling=pb.POOLING_MODEL)), timeout=30)
        self.sent["Encode", EMBED] += 1
        self.stub.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS, model=RERANK), timeout=30)
        self.sent["Rerank", RERANK] += 1
        for model in MODELS:
            answer = self.http.post("/v1/encode", json={"model": model, "sequences": [{"text": TEXTS[0]}]})
            assert answer.status_code == 200, answer.text
            self.sent["POST /v1/encode", model] += 1

    def close(self) -> None:
        self.http.close()
        self.channel.close()


@pytest.fixture(scope="module")
def caller(two_models: ServerProcess) -> Iterator[Caller]:
    made = Caller(two_models)
    try:
        yield made
    finally:
        made.close()


def last_scrape(prom: PrometheusServer) -> float:
    """When Prometheus last scraped the service (its clock, seconds)."""
    (up,) = prom.query(f'timestamp(up{{job="{JOB}"}})')
    return up.value


def next_scrape(prom: PrometheusServer, after: float) -> None:
    """Wait (on Prometheus) for a scrape of the service later than `after`."""
    prom.wait_for(f'timestamp(up{{job="{JOB}"}})', lambda r: bool(r) and r[0].value > after, timeout=30)


def finite(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if math.isfinite(s.value)]


# --- (a) the families and the counts ---------------------------------------------------------------------


def test_every_model_family_has_series_for_each_model_and_the_counts_add_up(
        prom: PrometheusServer, caller: Caller) -> None:
    for _ in range(3):
        caller.round()
    methods = "|".join(sorted({method for method, _ in caller.sent}))
    counted = f'sum by (model, method) (attention_requests_total{{job="{JOB}", code="OK", method=~"{methods}"}})'

    def as_sent(result: list[Sample]) -> bool:
        return {(s.labels["method"], s.labels["model"]): s.value for s in result} == caller.sent

    result = prom.wait_for(counted, as_sent, timeout=60)
    assert {(s.labels["method"], s.labels["model"]): s.value for s in result} == dict(caller.sent)
    by_model = prom.query(f'sum by (model) (attention_requests_total{{job="{JOB}", code="OK"}})')
    assert {s.labels["model"] for s in by_model if s.value > 0} >= set(MODELS), by_model

    with_model = sorted(name for name, (_, labels) in metric_families().items() if "model" in labels)
    assert set(FAMILIES_NOT_EXPECTED) <= set(with_model), "an exclusion names a family that is gone"
    missing = {}
    for name in with_model:
        if name in FAMILIES_NOT_EXPECTED:
            continue
        kind = metric_families()[name][0]
        series = f"{name}_count" if kind == "histogram" else name
        seen = {s.labels.get("model") for s in prom.query(f'count by (model) ({series}{{job="{JOB}"}})')}
        if not set(MODELS) <= seen:
            missing[name] = sorted(m for m in seen if m is not None)
    assert not missing, f"families without a series for each of {MODELS} (family: models seen): {missing}"


# --- (b) the dashboard -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    panel: str
    ref: str
    expr: str
    legend: str

    @property
    def where(self) -> str:
        return f"panel {self.panel!r} target {self.ref}"

    @property
    def per_model(self) -> bool:
        return "$model" in self.expr or "${model" in self.expr


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_targets() -> list[Target]:
    return [Target(panel["title"], target.get("refId", ""), target["expr"], target.get("legendFormat", ""))
            for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def parse_seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text)
    assert match, f"not a Grafana interval: {text!r}"
    return int(match[1]) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[match[2]]


def grafana_intervals() -> dict[str, str]:
    """Grafana's built-in interval variables for the shipped datasource: $__interval is its timeInterval
    (the floor, which the dashboard's 1 h range gives on a panel wider than 720 px), and $__rate_interval
    = max($__interval + timeInterval, 4 x timeInterval)."""
    (source,) = yaml.safe_load(DATASOURCE.read_text())["datasources"]
    scrape = parse_seconds(source["jsonData"]["timeInterval"])
    return {"__interval": f"{scrape:g}s", "__rate_interval": f"{max(2 * scrape, 4 * scrape):g}s"}


_REGEX_SPECIAL = re.compile(r"[\\^$*+?.()|{}\[\]]")


def grafana_regex_value(value: str) -> str:
    """A value of a multi or include-All variable, as Grafana's Prometheus datasource writes it into a
    query: regex metacharacters escaped, the backslash doubled for the PromQL string."""
    return _REGEX_SPECIAL.sub(lambda m: "\\\\" + m[0], value)


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with every Grafana variable ($x, ${x}, ${x:fmt}, [[x]]) replaced; one without a value fails the
    test, so a variable added to the dashboard must be added here too."""
    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        assert name in values, f"dashboard variable ${name} has no value in this test: {expr}"
        return values[name]
    return _VARIABLE.sub(one, expr)


@dataclass(frozen=True)
class Variable:
    name: str
    selector: str
    label: str
    all_value: str


def template_variables() -> list[Variable]:
    """The dashboard's variables: each a `label_values(SELECTOR, LABEL)` query with an All option."""
    variables = []
    for variable in dashboard()["templating"]["list"]:
        assert variable["type"] == "query", variable
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {variable['name']}: not a label_values query: {query}"
        assert variable.get("includeAll") and variable.get("allValue"), f"{variable['name']}: All is {variable}"
        variables.append(Variable(variable["name"], match[1], match[2], variable["allValue"]))
    return variables


def panel_problem(prom: PrometheusServer, target: Target, values: dict[str, str], model: str | None) -> str | None:
    """Why `target` shows nothing (or the wrong lines) with these variable values, or None when it shows
    data; `model` is the one model selected (None: All)."""
    expr = substitute(target.expr, values)
    result = finite(prom.query(expr))
    if not result:
        return f"no data: {expr}"
    lines = {s.labels.get("model") for s in result}
    if "{{model}}" in target.legend:
        want = {model} if model is not None else set(MODELS)
        if (lines != want) if model is not None else not want <= lines:
            return f"lines for models {sorted(str(m) for m in lines)}, want {sorted(want)}: {expr}"
    return None


# On a failure the load runs to its bound (60 scrapes) before the report: more than pytest's 120 s default.
@pytest.mark.timeout(300)
def test_every_dashboard_query_shows_each_model(prom: PrometheusServer, caller: Caller) -> None:
    variables = template_variables()
    by_name = {v.name: v for v in variables}
    assert "model" in by_name, "the dashboard has no model selector"
    # The selector offers exactly the models served, as Grafana's variable query reads them from Prometheus.
    offered = prom.wait_for(f'count by (model) (attention_model_info{{job="{JOB}"}})', lambda r: len(r) >= 2)
    assert {s.labels["model"] for s in offered} == set(MODELS)
    model_var = by_name["model"]
    assert sorted(prom.label_values(model_var.label, model_var.selector)) == sorted(MODELS)

    targets = dashboard_targets()
    excluded = [t for t in targets if any(t.panel.startswith(p) for p in PANELS_NOT_EXPECTED)]
    assert excluded, f"an exclusion names a panel that is gone: {sorted(PANELS_NOT_EXPECTED)}"
    checked = [t for t in targets if t not in excluded]
    assert sum(t.per_model for t in checked) >= 20, "the dashboard lost its per-model queries"

    def values(model: str | None) -> dict[str, str]:
        # The other variables at All (their allValue, as shipped); $model one model or All.
        chosen = {v.name: v.all_value for v in variables}
        if model is not None:
            chosen["model"] = grafana_regex_value(model)
        return {**chosen, **grafana_intervals()}

    # Each (target, selection): a per-model query for each model alone and for All; the others once.
    pending: dict[tuple[Target, str | None], str] = {}
    for target in checked:
        for model in ((*MODELS, None) if target.per_model else (None,)):
            pending[target, model] = "not evaluated"

    # Calls keep coming, a round per scrape, until every query has shown its data once: a rate needs two
    # scrapes that differ, which on a busy machine takes an unknown number of rounds; bounded in rounds and
    # in seconds.
    deadline = time.monotonic() + MAX_SECONDS
    rounds = 0
    while pending and rounds < MAX_ROUNDS and time.monotonic() < deadline:
        scraped = last_scrape(prom)
        caller.round()
        rounds += 1
        next_scrape(prom, scraped)
        for key in list(pending):
            problem = panel_problem(prom, key[0], values(key[1]), key[1])
            if problem is None:
                del pending[key]
            else:
                pending[key] = problem
    shown = "\n".join(f"  {t.where} with $model={m or 'All'}: {why}" for (t, m), why in pending.items())
    assert not pending, f"after {rounds} rounds of calls, dashboard queries without their data:\n{shown}"

    # The other variables' queries offer what the service exports (the instance scraped, both models' layers).
    for variable in variables:
        offered_values = prom.label_values(variable.label, variable.selector)
        assert offered_values, f"variable {variable.name}: {variable.selector} offers nothing"


def test_the_dashboard_check_fails_on_a_broken_selector(prom: PrometheusServer, caller: Caller) -> None:
    """The check above can fail: a query whose model selector or per-model grouping is broken is caught."""
    caller.round()
    variables = template_variables()
    chosen = {**{v.name: v.all_value for v in variables}, **grafana_intervals(), "model": EMBED}
    good = next(t for t in dashboard_targets() if t.panel == "Request rate by code")
    prom.wait_for(substitute(good.expr, chosen), lambda r: bool(finite(r)), timeout=60)
    assert panel_problem(prom, good, chosen, EMBED) is None
    typo = Target(good.panel, good.ref, good.expr.replace('model=~"$model"', 'model=~"$model-x"'), good.legend)
    assert (panel_problem(prom, typo, chosen, EMBED) or "").startswith("no data")
    ungrouped = Target(good.panel, good.ref, good.expr.replace("by (model, code)", "by (code)"), good.legend)
    assert "lines for models" in (panel_problem(prom, ungrouped, chosen, EMBED) or "")
    unfiltered = Target(good.panel, good.ref, good.expr.replace(', model=~"$model"', ""), good.legend)
    assert "lines for models" in (panel_problem(prom, unfiltered, chosen, EMBED) or "")


def test_grafana_substitution() -> None:
    assert substitute('x{m=~"$model", i=~"${instance}"}[$__rate_interval] [[layer]]',
                      {"model": "a", "instance": ".*", "__rate_interval": "20s", "layer": "1"}) == \
        'x{m=~"a", i=~".*"}[20s] 1'
    assert grafana_regex_value("bge-reranker.v1") == "bge-reranker\\\\.v1"
    assert grafana_intervals()["__rate_interval"] == "20s"  # the shipped datasource's timeInterval is 5 s
    with pytest.raises(AssertionError, match=r"\$unknown"):
        substitute("rate(x[$unknown])", {})


# --- each door counts under the model it ran on ----------------------------------------------------------


def _kserve_text(texts: list[str]) -> Any:
    text = triton_grpc.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.asarray([t.encode() for t in texts], dtype=object))
    return text


def _openai(server: ServerProcess, model: str) -> str:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.ports['http_port']}", trust_env=False) as http:
        answer = http.post("/v1/embeddings", json={"model": model, "input": TEXTS}, timeout=30)
    assert answer.status_code == 200, answer.text
    return "POST /v1/embeddings"


def _kserve_rest(server: ServerProcess, model: str) -> str:
    body: dict[str, Any] = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}]}
    if model == RERANK:
        body["parameters"] = {"query": QUERY}
    with httpx.Client(base_url=f"http://127.0.0.1:{server.ports['http_port']}", trust_env=False) as http:
        answer = http.post(f"/v2/models/{model}/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return "POST /v2/models/{model}/infer"


def _kserve_grpc(server: ServerProcess, model: str) -> str:
    client = triton_grpc.InferenceServerClient(server.target)
    try:
        client.infer(model, [_kserve_text(TEXTS)], parameters={"query": QUERY} if model == RERANK else None)
    finally:
        client.close()
    return "ModelInfer"


def _attention(server: ServerProcess, model: str) -> str:
    with grpc.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        if model == RERANK:
            stub.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS, model=model), timeout=30)
            return "Rerank"
        stub.Encode(pb.EncodeRequest(sequences=[pb.Sequence(text=t) for t in TEXTS], model=model), timeout=30)
        return "Encode"


DOORS: dict[str, Callable[[ServerProcess, str], str]] = {
    "attention.v1": _attention, "openai": _openai, "kserve-grpc": _kserve_grpc, "kserve-rest": _kserve_rest}
# This test found the OpenAI route and KServe infer counting a call to another model under the default one
# (a door's readiness lookup set the call's model first); Calls.run now sets it for the model the call runs on.
@pytest.mark.parametrize(("door", "model"), [(door, model) for door in DOORS for model in MODELS])
def test_each_door_counts_a_call_under_the_model_it_ran_on(two_models: ServerProcess, door: str,
                                                             model: str) -> None:
    def counts() -> dict[str, float]:
        return {m: two_models.sample("attention_requests_total", {"code": "OK", "model": m}) for m in MODELS}

    before = counts()
    method = DOORS[door](two_models, model)
    after = counts()
    assert {m: after[m] - before[m] for m in MODELS} == {m: float(m == model) for m in MODELS}, method
