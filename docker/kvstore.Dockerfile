# graphmesh KV store. Build from the repository root:
#   docker build -f docker/kvstore.Dockerfile -t graphmesh/kvstore:0.1.0 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini as PID 1 forwards SIGTERM, so a pod stops at once instead of after the grace period.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

COPY clients/python /src/clients/python
COPY services/common /src/services/common
COPY services/kvstore /src/services/kvstore
RUN pip install --no-cache-dir /src/clients/python /src/services/common /src/services/kvstore

RUN groupadd --system --gid 10001 graphmesh \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin graphmesh
# /data is the optional disk tier; the chart mounts a volume there when kvstore.persistence is on.
RUN mkdir -p /data && chown 10001:10001 /data
# Numeric, so the kubelet can check runAsNonRoot.
USER 10001:10001
WORKDIR /tmp
ENV HOME=/tmp

# gRPC, Prometheus metrics.
EXPOSE 50052 9090
ENTRYPOINT ["tini", "--", "graphmesh-kvstore"]
CMD ["--listen", "0.0.0.0:50052", "--capacity-bytes", "1073741824", "--metrics-port", "9090"]
