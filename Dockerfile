# hoist: serve GGUF model loads over HTTP.
#   docker build -t hoist .
#   docker run -p 8000:8000 -v "$PWD/models:/models:ro" -e HOIST_API_TOKEN="$(openssl rand -hex 32)" \
#       --memory 8g hoist
# The service listens on all addresses inside the container, so it needs a bearer token:
# HOIST_API_TOKEN, or HOIST_API_TOKEN_FILE naming a mounted secret. Without one it
# refuses to start and says so.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HOIST_MODELS_DIR=/models

WORKDIR /app

# dependencies first, so code changes do not reinstall them
COPY pyproject.toml README.md ./
RUN mkdir -p service && touch service/__init__.py \
    && pip install . \
    && pip uninstall -y hoist

COPY service ./service
RUN pip install --no-deps .

RUN useradd --create-home --uid 10001 hoist \
    && mkdir -p /models \
    && chown hoist:hoist /models
USER hoist

VOLUME ["/models"]
EXPOSE 8000

# /healthz needs no token
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status == 200 else 1)"

CMD ["hoist", "serve", "--host", "0.0.0.0", "--port", "8000"]
