# syntax=docker/dockerfile:1
# The tslice image: the orchestrator (runs as the non-root user below) and the node agent
# (the same image; the agent DaemonSet runs it privileged, as root). Build and push:
#   docker build -t registry.example.com/tslice:0.1.0 . && docker push registry.example.com/tslice:0.1.0
# (docs/deploy-kubernetes.md: other builders, other architectures.)
#
# Base image pinned by tag; pin it by digest too for reproducible builds, e.g.
#   FROM python:3.12-slim-trixie@sha256:<digest>
# with the digest from `docker buildx imagetools inspect python:3.12-slim-trixie`
# (same in both stages).
ARG PYTHON_IMAGE=python:3.12-slim-trixie

# ---- build: the tslice wheel and the wheels of everything it installs -----------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# `pip wheel` builds tslice (setuptools in an isolated build environment, discarded) and
# collects the dependency wheels, so that the final stage installs offline, from /wheels.
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[server,kubernetes,gpu]"

# ---- final: no compilers, no build backend, no sources ----------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tslice" \
      org.opencontainers.image.description="Co-operative time-slicing of accelerators between jobs: orchestrator and node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
# A venv without pip: pip is the base image's, driven from outside (--python).
# DL3013 (pin pip versions): the install is offline from /wheels, which holds exactly the
# tslice wheel and the dependency versions the build stage resolved; there is nothing else
# to pick from. (tslice has no lock file: those versions are the newest within
# pyproject.toml's ranges on the day of the build.)
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv --without-pip /opt/tslice \
    && pip --python /opt/tslice/bin/python install --no-cache-dir --no-index \
        --find-links /wheels "tslice[server,kubernetes,gpu]" \
    && groupadd --system --gid 10001 tslice \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin tslice
ENV PATH=/opt/tslice/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# orchestrator gRPC, metrics (both servers), agent gRPC
EXPOSE 50051 8080 9001
USER 10001:10001
ENTRYPOINT ["tslice"]
CMD ["--help"]
