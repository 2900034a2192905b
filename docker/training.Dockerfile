# syntax=docker/dockerfile:1.7
#
# gangflow training image: what every rank of a gang runs
#   torchrun [multi-node flags] -m trainer --run-dir DIR --config params.yaml [--set k=v ...]
#
# Build from the repository root (the context needs constraints.txt, pyproject.toml, README.md,
# operators/, trainer/, params.yaml and docker/training-requirements.txt; see
# docker/training.Dockerfile.dockerignore):
#   docker buildx build -f docker/training.Dockerfile \
#     -t registry.example.com/gangflow/training:0.1.0 --push .
# Put the digest the push prints into the gangflow chart's training.image.digest.
#
# Layers: the platform layer (Python 3.11 and the trainer's third-party wheels at the versions of
# constraints.txt, about 1.5 GB) changes only with constraints.txt; the project layers (the gangflow
# package with its CRD schemas and failure corpus, params.yaml, the pipelines' configs, the examples)
# change with every commit and weigh about 12 MB, all a commit pushes and pulls
# (tests/system/images/test_images.py).
# torch==2.13.0 from PyPI is the CUDA build on linux/amd64; torch pins its nvidia-* wheels itself.
# `make images` (operators/cli/images.py) builds it with podman instead: from a Debian base it makes
# itself when PYTHON_IMAGE cannot be pulled, with the wheels this machine's pip resolves (the CPU
# torch) mounted at WHEELHOUSE, and the host's CA bundle as the build secret `ca` (never in a layer).

# Replace the digest with the one of the python:3.11-slim-bookworm image you audited
# (docker buildx imagetools inspect python:3.11-slim-bookworm).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:0000000000000000000000000000000000000000000000000000000000000000

# ---------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS platform
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Platform layer: pinned third-party dependencies. WHEELHOUSE (optional): a folder of wheels mounted
# into the build (podman build -v DIR:/wheelhouse:ro) that pip prefers, e.g. the CPU torch. The
# secret `ca` (optional): a CA bundle pip trusts, for an index behind a TLS-intercepting proxy.
ARG WHEELHOUSE=
COPY constraints.txt docker/training-requirements.txt ./
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install ${WHEELHOUSE:+--find-links "$WHEELHOUSE"} "pip==25.3" \
 && pip install ${WHEELHOUSE:+--find-links "$WHEELHOUSE"} -c constraints.txt -r training-requirements.txt

# The gangflow package (packages operators and trainer), installed into a folder of its own that the
# runtime stage lays over the venv's site-packages as one small layer. --no-deps keeps Airflow, DVC
# and Great Expectations (the orchestration side) out of the rank image; --no-build-isolation builds
# it with the venv's setuptools (torch requires it), so this stage needs no index.
FROM platform AS project
COPY pyproject.toml README.md ./
COPY operators/ operators/
COPY trainer/ trainer/
RUN pip install --no-deps --no-build-isolation --target /opt/gangflow . \
 && PYTHONPATH=/opt/gangflow python -m trainer --help > /dev/null

# The venv the ranks run: the platform's, without the tools that install packages.
FROM platform AS venv
RUN pip uninstall -y setuptools wheel pip

# ---------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="gangflow-training" \
      org.opencontainers.image.description="gangflow trainer: torchrun -m trainer" \
      org.opencontainers.image.licenses="Apache-2.0"
# Non-root user; the chart's training.runAsUser/runAsGroup/fsGroup (10001) match it.
RUN groupadd --system --gid 10001 gangflow \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin gangflow
COPY --from=venv /opt/venv /opt/venv
# The project layer: the package over the venv's site-packages (Python 3.11, as PYTHON_IMAGE's).
COPY --from=project /opt/gangflow/ /opt/venv/lib/python3.11/site-packages/
WORKDIR /app
COPY params.yaml /app/params.yaml
# The other pipelines' trainer configs (pipelines/trainer/*.yaml), named relative to /app by the DAGs.
COPY pipelines/trainer/ /app/pipelines/trainer/
# Training code of one's own: each pipeline's package_roots below /app (the pods get
# PYTHONPATH=/app/<root>); here the examples' (docs/kubernetes.md, "Your own code").
COPY examples/ /app/examples/
# The pods run with a read-only root filesystem: caches go to the /tmp emptyDir.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    MPLCONFIGDIR=/tmp/matplotlib \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor
USER 10001:10001
ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc-per-node=1", "-m", "trainer", "--help"]
