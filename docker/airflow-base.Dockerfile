# syntax=docker/dockerfile:1.7
#
# gangflow's own Airflow base, for machines that cannot pull apache/airflow:3.3.2-python3.11 (the
# default AIRFLOW_IMAGE of docker/airflow.Dockerfile): Debian's Python 3.11, the user airflow
# (uid 50000, gid 0) with a virtualenv at /home/airflow/.local on PATH (where the official image
# keeps its user site) and apache-airflow at the constraints.txt pin. `make images` builds it:
#   podman build -f docker/airflow-base.Dockerfile --build-arg PYTHON_IMAGE=localhost/gangflow/base:bookworm \
#     --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt .
# then docker/airflow.Dockerfile with --build-arg AIRFLOW_IMAGE=<this image>.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:0000000000000000000000000000000000000000000000000000000000000000
FROM ${PYTHON_IMAGE}
RUN useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow --shell /bin/bash airflow \
 && mkdir -p /opt/airflow/dags /opt/gangflow \
 && chown -R airflow:0 /opt/airflow /opt/gangflow
USER airflow
RUN python -m venv /home/airflow/.local
ENV PATH=/home/airflow/.local/bin:$PATH \
    AIRFLOW_HOME=/opt/airflow \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/airflow
# WHEELHOUSE and the secret `ca`: as in docker/training.Dockerfile (both optional).
ARG WHEELHOUSE=
RUN --mount=type=secret,id=ca,required=false,mode=0444 \
    --mount=type=bind,source=constraints.txt,target=/tmp/constraints.txt \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install ${WHEELHOUSE:+--find-links "$WHEELHOUSE"} "pip==25.3" \
 && pip install ${WHEELHOUSE:+--find-links "$WHEELHOUSE"} -c /tmp/constraints.txt "apache-airflow==3.3.2"
ENTRYPOINT ["airflow"]
CMD ["version"]
