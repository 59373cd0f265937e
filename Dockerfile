# hoist: serve GGUF model loads over HTTP.
#
#   docker build -t hoist .
#   docker run -p 8000:8000 --read-only --tmpfs /tmp --cap-drop ALL --memory 8g \
#       -v "$PWD/models:/models:ro" -v "$PWD/token:/run/secrets/hoist_api_token:ro" \
#       -e HOIST_API_TOKEN_FILE=/run/secrets/hoist_api_token hoist
#
# CUDA image (PyTorch and its CUDA libraries come from the base image; its Python must be
# the version constraints.txt was written for, 3.11):
#
#   docker build -t hoist:cuda --build-arg HOIST_EXTRAS=cuda \
#       --build-arg BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime .
#
# The service listens on all addresses inside the container, so it needs a bearer token:
# HOIST_API_TOKEN_FILE naming a mounted secret (or HOIST_API_TOKEN). Without one it refuses
# to start and says so. No token is built into the image.
#
# Every dependency is installed at the version pinned in constraints.txt, the file the
# test command installs from too. The image writes nothing outside /tmp: run it with a
# read-only root file system and a tmpfs on /tmp.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment in /opt/hoist with the pinned dependencies and hoist
FROM ${BASE_IMAGE} AS build
ARG HOIST_EXTRAS=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# system site packages are visible so that a base image's PyTorch is used, not reinstalled
RUN python3 -m venv --system-site-packages /opt/hoist
WORKDIR /src

# dependencies first, so that a code change does not reinstall them
COPY constraints.txt pyproject.toml README.md ./
RUN mkdir service && touch service/__init__.py \
    && /opt/hoist/bin/pip install -c constraints.txt ".${HOIST_EXTRAS:+[$HOIST_EXTRAS]}" \
    && /opt/hoist/bin/pip uninstall -y hoist

COPY service ./service
RUN /opt/hoist/bin/pip install --no-deps . \
    && /opt/hoist/bin/python -m compileall -q /opt/hoist/lib

# ---- runtime: the environment alone, run by an unprivileged user
FROM ${BASE_IMAGE} AS runtime

LABEL org.opencontainers.image.title="hoist" \
      org.opencontainers.image.description="Load GGUF model weights onto devices the way llama.cpp does, and serve it over HTTP."

# HOME and the caches point into /tmp: the root file system may be read-only
ENV PATH=/opt/hoist/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    CUDA_CACHE_PATH=/tmp/.nv \
    HOIST_MODELS_DIR=/models

RUN groupadd --system --gid 10001 hoist \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin hoist \
    && mkdir -p /models

COPY --from=build /opt/hoist /opt/hoist

# numeric, so that Kubernetes' runAsNonRoot can check it
USER 10001:10001
WORKDIR /tmp

VOLUME ["/models"]
EXPOSE 8000

# /healthz needs no token
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status == 200 else 1)"]

CMD ["hoist", "serve", "--host", "0.0.0.0", "--port", "8000"]
