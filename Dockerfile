# syntax=docker/dockerfile:1
# The pdpair operator and router image: python -m pdpair.operator (default) or python -m pdpair.router.
# Two stages: `build` has gcc for the cffi extension (pdpair.native, compiled from native/) and installs everything
# into a venv; `runtime` copies only that venv, and runs as a non-root user. See images/README.md.
#   docker build -t ghcr.io/pdpair/pdpair:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the wheel is built from (the .dockerignore keeps the context small as well).
COPY pyproject.toml setup.py README.md ./
COPY native/include native/include
COPY native/src native/src
COPY src src
RUN python -m venv /opt/pdpair \
 && /opt/pdpair/bin/pip install --upgrade pip setuptools wheel \
 && /opt/pdpair/bin/pip install ".[operator,connector]"
# Fail the build here, not in the cluster, if a package or the native extension does not load. Run from / so the
# installed packages are imported, not the source folders (/src/src would shadow nothing, but be sure).
WORKDIR /
RUN /opt/pdpair/bin/python -c "import pdpair.contract, pdpair.operator, pdpair.connector, pdpair.router, pdpair.native, kopf, kubernetes"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="pdpair" \
      org.opencontainers.image.description="pdpair operator and router (prefill/decode vLLM pairs on Kubernetes)" \
      org.opencontainers.image.licenses="Apache-2.0"
# The same base image as `build`, so the venv's interpreter symlinks (/usr/local/bin/python3.11) resolve.
COPY --from=build /opt/pdpair /opt/pdpair
# uid/gid 10001 match the chart's podSecurityContext (runAsUser/runAsGroup); no home, no login shell.
RUN groupadd --system --gid 10001 pdpair \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin pdpair
ENV PATH=/opt/pdpair/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# kopf liveness (PDPAIR_LIVENESS_PORT) and metrics (PDPAIR_OPERATOR_METRICS_PORT) defaults.
EXPOSE 8080 9090
CMD ["python", "-m", "pdpair.operator"]
