# The attention service image. No `# syntax=` directive: BuildKit would pull that frontend image from a
# registry on every build, which breaks offline and air-gapped builds; the built-in frontend suffices. GPU by default: the base is a CUDA PyTorch runtime image and its own torch
# build is kept (never replaced by a PyPI wheel). CPU: build with
#   --build-arg BASE_IMAGE=python:3.11-slim --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (docker-compose.cpu.yml does this). The base's CUDA must suit the host driver: the cuda12.x tags run on
# NVIDIA drivers >= 525 (minor-version compatibility), the cuda13.x tags need >= 580.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

# Stage 1: build the project wheel, so the runtime image holds no source tree, build tools or pip caches.
FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
# README.m[d]: the wheel's long description when the file is there; the build does not need it.
COPY pyproject.toml README.m[d] ./
COPY proto ./proto
COPY model ./model
COPY service ./service
COPY client ./client
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the runtime image.
FROM ${BASE_IMAGE}
# Index for torch when the base image has none (the CPU variant); empty = PyPI.
ARG TORCH_INDEX=""
# The pytorch/pytorch images use Ubuntu's system Python, which is "externally managed" (PEP 668). This
# image serves one application, so installing into it is what we want. ARG, not ENV: build time only.
ARG PIP_BREAK_SYSTEM_PACKAGES=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

COPY requirements.txt /tmp/requirements.txt
COPY --from=wheel /wheels /tmp/wheels
# Keep the base image's torch (CUDA build) when it has one; otherwise install the pinned version from
# TORCH_INDEX. Then the other pinned requirements, then the project itself without dependencies.
RUN set -eu; \
    grep -E '^torch==' /tmp/requirements.txt > /tmp/requirements-torch.txt; \
    grep -vE '^torch==' /tmp/requirements.txt > /tmp/requirements-rest.txt; \
    if python -c "import torch" 2>/dev/null; then \
        python -c "import torch; print('keeping the base image torch', torch.__version__)"; \
    else \
        python -m pip install --no-cache-dir ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} \
            -r /tmp/requirements-torch.txt; \
    fi; \
    python -m pip install --no-cache-dir -r /tmp/requirements-rest.txt; \
    python -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl; \
    python -c "import client.health, service"; \
    rm -rf /tmp/requirements*.txt /tmp/wheels

# A fixed non-root uid/gid, so docker-compose.yml can name it and volumes get the right owner. The cache
# dir is where the built-in default model is built on first start; compose mounts a volume there.
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --no-log-init --create-home --home-dir /home/app \
        --shell /usr/sbin/nologin app \
    && mkdir -p /var/cache/attention-service \
    && chown app:app /var/cache/attention-service

ENV ATTN_HOST=0.0.0.0 \
    ATTN_PORT=50051 \
    ATTN_METRICS_PORT=9464 \
    ATTN_CACHE_DIR=/var/cache/attention-service \
    MPLCONFIGDIR=/tmp/matplotlib

USER 10001:10001
WORKDIR /home/app
EXPOSE 50051 9464

# The standard gRPC health protocol (SERVING only after warm-up), not a TCP check. start-period covers
# building the default model and warming up on first start; the container is healthy at the first
# probe after warm-up (within one 10 s interval). No --start-interval: Docker Engine before 25 (Debian
# 12's 20.10) refuses the whole Dockerfile for it ("Unknown flag: start-interval").
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-m", "client.health", "--target", "127.0.0.1:50051", "--timeout", "2"]

# Exec form: Python is the process that receives SIGTERM and drains (run with an init, e.g. `init: true`
# in compose, so zombies are reaped and signals are forwarded).
STOPSIGNAL SIGTERM
CMD ["python", "-m", "service"]
