# Thin wrappers; every target creates the virtual environment first when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt | cksum | cut -d' ' -f1)
PROTOS := proto/attention/v1/attention.proto

.PHONY: venv run test test-fast proto lint typecheck check bench bench-model system-deps clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-dev.txt
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

run: $(STAMP)  ## start the service on the built-in default model (127.0.0.1:50051, metrics 127.0.0.1:9464)
	$(BIN)/python -m service

system-deps:  ## Debian packages the tests use (prometheus, promtool); no-op when present
	bash deploy/system-deps.sh

test: $(STAMP) system-deps  ## the whole suite, as CI runs it
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)  ## the suite without the soak and slow tests
	$(BIN)/python -m pytest -q -m "not soak and not slow"

proto: $(STAMP)  ## regenerate the committed stubs from the .proto
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

bench-model: $(STAMP)  ## the model's in-process ceiling (bench/RESULTS.md)
	$(BIN)/python -m bench.model_bench

bench: $(STAMP)  ## the service against its ceiling (bench/RESULTS.md)
	$(BIN)/python -m bench.service_bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .cache
