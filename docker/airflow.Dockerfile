# syntax=docker/dockerfile:1.7
#
# gangflow Airflow image: the official apache/airflow 3.3.2 image (platform layer) plus the gangflow
# package and its DAGs (project layer). Used for every Airflow component of the official chart
# (helm/airflow-values.yaml: images.airflow).
#
# Build from the repository root (see docker/airflow.Dockerfile.dockerignore):
#   docker buildx build -f docker/airflow.Dockerfile \
#     -t registry.example.com/gangflow/airflow:3.3.2-gangflow-0.1.0 --push .
# Put the digest the push prints into helm/airflow-values.yaml (images.airflow.digest).
# Where apache/airflow cannot be pulled, `make images` builds docker/airflow-base.Dockerfile (Debian,
# the user airflow, apache-airflow 3.3.2) and passes it as AIRFLOW_IMAGE.

# Replace the digest with the one of apache/airflow:3.3.2-python3.11 you audited
# (docker buildx imagetools inspect apache/airflow:3.3.2-python3.11).
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11@sha256:0000000000000000000000000000000000000000000000000000000000000000
FROM ${AIRFLOW_IMAGE}

# The official image runs as the non-root user airflow (uid 50000, gid 0) and installs into its
# user site; stay that user.
USER airflow
ENV GANGFLOW_PROJECT=/opt/gangflow \
    PIP_NO_CACHE_DIR=1

# Project layer 1: the dependencies of the package and of its Kubernetes extra, read from
# pyproject.toml, versions from constraints.txt. Naming apache-airflow==3.3.2 too keeps pip from
# moving the Airflow the base image ships. Before the source, so a code change rebuilds from layer 2.
COPY --chown=airflow:0 constraints.txt pyproject.toml /opt/gangflow/
# WHEELHOUSE and the secret `ca`: as in docker/training.Dockerfile (both optional; `make images` gives them).
ARG WHEELHOUSE=
RUN --mount=type=secret,id=ca,required=false,mode=0444 \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python -c 'import tomllib; p = tomllib.load(open("/opt/gangflow/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["kubernetes"]))' > /tmp/gangflow-requirements.txt \
 && pip install ${WHEELHOUSE:+--find-links "$WHEELHOUSE"} -c /opt/gangflow/constraints.txt "apache-airflow==3.3.2" -r /tmp/gangflow-requirements.txt \
 && rm /tmp/gangflow-requirements.txt

# Project layer 2: the package itself (operators, trainer); its dependencies are layer 1's.
COPY --chown=airflow:0 README.md /opt/gangflow/
COPY --chown=airflow:0 operators/ /opt/gangflow/operators/
COPY --chown=airflow:0 trainer/ /opt/gangflow/trainer/
RUN --mount=type=secret,id=ca,required=false,mode=0444 \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install ${WHEELHOUSE:+--find-links "$WHEELHOUSE"} --no-deps /opt/gangflow

# Project layer 3: what the DAGs read beside the package (GANGFLOW_PROJECT: params.yaml, the
# pipeline files, the DVC pipeline and its lock, the data stages and expectation suites), then
# the DAGs. User model packages: add a layer `COPY mypkg/ /opt/gangflow/mypkg/` (importable from
# GANGFLOW_PROJECT by the DAG processor and tasks) or pip-install them here (docs/extending.md).
COPY --chown=airflow:0 params.yaml dvc.yaml dvc.lock .dvcignore /opt/gangflow/
COPY --chown=airflow:0 pipelines/ /opt/gangflow/pipelines/
COPY --chown=airflow:0 .dvc/config /opt/gangflow/.dvc/config
COPY --chown=airflow:0 data/prepare.py data/expectations.py /opt/gangflow/data/
COPY --chown=airflow:0 dags/ /opt/airflow/dags/
# The commit the image was built from (there is no .git in it): the lineage the registry records,
# which refuses "unknown" (docs/registry.md). --build-arg GANGFLOW_GIT_COMMIT=$(git rev-parse HEAD)
ARG GANGFLOW_GIT_COMMIT=unknown
ARG GANGFLOW_GIT_DIRTY=unknown
ENV GANGFLOW_GIT_COMMIT=${GANGFLOW_GIT_COMMIT} GANGFLOW_GIT_DIRTY=${GANGFLOW_GIT_DIRTY}
