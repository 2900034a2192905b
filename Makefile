# gangflow: the two set-up commands are `make demo` and `make test`; `make ui` starts Airflow.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gangflow-installed
export PATH := $(abspath $(BIN)):$(PATH)

PIPELINE ?= digits
# Launch API of the cluster drill: jobset, trainjob (run as Kubeflow Trainer v2 would run it), mpijob
# (as the MPI Operator v2 would) or rayjob (as KubeRay would: a local Ray cluster, `ray job submit`)
API ?= jobset

.PHONY: install browser-deps prometheus-deps podman-deps images setup data demo baseline cluster-drill test test-fast ui benchmarks constraints clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip==25.3"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[kubernetes,frameworks,ray,mpi,dev]"
	touch $(STAMP)

# State dir (GANGFLOW_HOME, default .gangflow/): Airflow DB + pool, MLflow store, DVC remote, data.
setup: install
	$(BIN)/python -m operators.cli.setup

# Rebuild the datasets with `dvc repro` (dvc.yaml): the venv comes first on PATH (exported above),
# so the stages' `python` is the project's interpreter.
data: install
	$(BIN)/dvc repro

# Runs one pipeline's DAG once on the embedded defaults (PIPELINE=digits|diabetes|<yours>, a file
# under pipelines/; BACKEND=local|ray and LAUNCHER=torchrun|mpirun override the pipeline file's):
# an account of the run, then a JSON summary as the last line. Its setup publishes (dvc repro +
# push) that pipeline's dataset only.
demo: install
	$(BIN)/python -m operators.cli.setup --pipeline $(PIPELINE)
	$(BIN)/python -m operators.cli.demo --pipeline $(PIPELINE) $(if $(BACKEND),--backend $(BACKEND)) $(if $(LAUNCHER),--launcher $(LAUNCHER))

# The platform_baseline DAG once (collective bandwidth, DVC read throughput, step time per topology),
# compared with the last accepted baseline; the last line is a JSON summary (docs/observability.md).
baseline: setup
	$(BIN)/python -m operators.cli.baseline

# One pipeline's DAG (PIPELINE=, as demo) with backend=kubernetes, the rendered pods run as local
# processes (RUNTIME=process) or as podman containers of the image `make images` built
# (RUNTIME=podman), S3 (moto) and MLflow servers on 127.0.0.1 (docs/kubernetes.md, "The cluster
# drill"); honours GANGFLOW_FAULT. API=trainjob submits a TrainJob that the drill's Kubeflow Trainer
# v2 controller turns into a JobSet from the chart's ClusterTrainingRuntime; API=mpijob and
# API=rayjob run the MPIJob and the RayJob as their operators would (docs/design/cluster-drill.md).
# MULTIKUEUE=2: two worker clusters behind a MultiKueue manager (GANGFLOW_DRILL_EVENT=lose-worker@step=N).
RUNTIME ?= process
MULTIKUEUE ?= 0
cluster-drill: setup
	$(BIN)/python -m operators.cli.drill --pipeline $(PIPELINE) --api $(API) --runtime $(RUNTIME) --multikueue $(MULTIKUEUE)

# The training and Airflow images of docker/, built with podman from bases made here when the
# official ones cannot be pulled; tags and sha256 digests in .gangflow/images/images.json.
images: install podman-deps
	$(BIN)/python -m operators.cli.images

# podman and what `make images` builds bases with; installed when missing (root, apt).
podman-deps:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null && command -v runc >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah mmdebstrap runc >/dev/null; } || echo "podman, mmdebstrap or runc missing: make images cannot build and the image tests (tests/system/images) skip; install Debian's podman buildah mmdebstrap runc"

# The tests start hundreds of Python processes that import the project: they keep its compiled
# modules (git-ignored __pycache__) even where the environment turns that off, which saved about a
# tenth of `make test-fast` (docs/design/test-times.md).
test test-fast: export PYTHONDONTWRITEBYTECODE =

# Every test on 2 pytest-xdist workers; tests that share a session fixture (a prepared state dir)
# stay on one worker (tests/conftest.py).
test: install browser-deps prometheus-deps podman-deps
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=60

# The UI test drives Debian's chromium headless; install it when missing (root, apt).
browser-deps:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || echo "chromium missing: the browser test will fail; install Debian's chromium"

# Unit tests only (tests/unit): no DAG run, no torchrun gang, no browser; the scrape-config test
# checks the chart's Prometheus configuration with promtool.
test-fast: install prometheus-deps
	$(BIN)/python -m pytest -n 2 --dist loadfile tests/unit

ui: setup
	$(BIN)/python -m operators.cli.ui

benchmarks: setup
	$(BIN)/python benchmarks/trainer.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/goodput.py
	$(BIN)/python benchmarks/checkpoint_interval.py
	$(BIN)/python benchmarks/validation.py
	$(BIN)/python benchmarks/restart.py
	$(BIN)/python benchmarks/classifier.py
	$(BIN)/python benchmarks/byo.py

constraints:
	rm -rf /tmp/gangflow-freeze && $(PYTHON) -m venv /tmp/gangflow-freeze
	/tmp/gangflow-freeze/bin/pip install -q -e ".[kubernetes,frameworks,ray,mpi,dev]"
	{ sed -n '1,2p' constraints.txt; /tmp/gangflow-freeze/bin/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf .gangflow data/digits data/diabetes data/corpus data/synthetic

# The metrics test runs Debian's Prometheus server on 127.0.0.1; install it when missing (root, apt).
prometheus-deps:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || echo "prometheus missing: the metrics test will fail; install Debian's prometheus"
