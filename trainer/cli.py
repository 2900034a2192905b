"""Command line of `python -m trainer` (run it under torchrun for several ranks)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from trainer import EXIT_CONFIG_ERROR, EXIT_PREEMPTED, EXIT_USER_ERROR
from trainer.config import SECTIONS, ModelConfig

PARAM_HELP = {
    "data.train_path": "training Parquet file (any name; read as Parquet)",
    "data.test_path": "test Parquet file, evaluated once at the end",
    "data.train_md5": 'refuse to start unless the train file has this md5 ("" = no check)',
    "data.factory": "dataset factory module:function, fn(path) -> Dataset of (features, label)",
    "data.num_workers": "DataLoader worker processes per rank",
    "data.remote": "DVC 3 remote, any fsspec URL (s3://bucket/dvc, file:///abs/remote); used with data.version",
    "data.version": 'dataset version (md5 of the DVC .dir object): fetch train/test.parquet by content address ("" = use the paths)',
    "model.factory": "model factory module:function, fn(**other model keys) -> nn.Module",
    "model.<key>": "any other key is a keyword argument of the model factory (input_dim is inferred)",
    "train.max_steps": "optimizer steps in total",
    "train.seed": "seed of the initial weights, sample order and RNGs",
    "train.batch_size": "GLOBAL batch size, split evenly over the ranks (must divide by the world size)",
    "train.lr": "peak learning rate",
    "train.momentum": "SGD momentum",
    "train.weight_decay": "weight decay",
    "train.warmup_steps": "linear warm-up steps",
    "train.log_every_steps": "metrics.jsonl (and MLflow) every N steps",
    "train.optimizer": "sgd | adamw",
    "train.lr_schedule": "cosine (to 0 at max_steps) | constant, after warm-up",
    "train.device": "auto (CUDA if present) | cpu | cuda",
    "checkpoint.every_steps": "commit a checkpoint every N steps (and always at the end); auto = Young/Daly "
                              "sqrt(2 * save cost * MTBF) in steps, from the pipeline's history or a probe save",
    "checkpoint.keep_last": "committed checkpoints to keep",
    "checkpoint.async_save": "commit checkpoints from a background thread: the loop does not wait (commit stays atomic)",
    "checkpoint.grace_period_s": "after SIGTERM, exit 75 at the latest after this many seconds",
    "checkpoint.mtbf_prior_s": "every_steps auto: the MTBF (seconds) assumed without failure history",
    "checkpoint.auto_min_steps": "every_steps auto: the fewest steps between checkpoints",
    "checkpoint.auto_max_steps": "every_steps auto: the most steps between checkpoints",
    "tracking.mlflow_uri": 'MLflow tracking URI ("" = env MLFLOW_TRACKING_URI, or metrics.jsonl only)',
    "tracking.experiment": "MLflow experiment of a new run (ignored with env MLFLOW_RUN_ID)",
    "tracking.flush_every_s": "send queued MLflow metrics every N seconds (background thread)",
    "tracking.progress_every_s": "rank 0 prints a progress line (and logs progress_* metrics) every N seconds; 0 = off",
}


def _params_table() -> str:
    lines = []
    for name, cls in SECTIONS.items():
        if cls is ModelConfig:
            m = ModelConfig()
            lines.append(f"  model.factory = {m.factory}\n      {PARAM_HELP['model.factory']}")
            lines.append(f"  model.<key>   (default: hidden=128, num_classes=10)\n      {PARAM_HELP['model.<key>']}")
            continue
        for f in fields(cls):
            key = f"{name}.{f.name}"
            lines.append(f"  {key} = {f.default!r}\n      {PARAM_HELP.get(key, '')}")
    return "\n".join(lines)


EPILOG = f"""\
parameters (params.yaml sections; any of them with --set section.key=value):
{_params_table()}

exit codes:
  0   trained; final weights at RUN_DIR/final/model.safetensors
  {EXIT_USER_ERROR}   the training raised (user code, bad data, or an unexpected error); see the
      error record's "source" in RUN_DIR/errors/rank-<R>.json
  {EXIT_CONFIG_ERROR}   bad option, params file, override or GANGFLOW_FAULT (nothing was started)
  {EXIT_PREEMPTED}  stopped on SIGTERM after committing a final checkpoint (run again to resume)

signals:
  SIGTERM   preemption: all ranks stop at the same step boundary, a final checkpoint is
            committed, exit 75 (under torchrun, SIGTERM the torchrun agent: it forwards it)

environment:
  GANGFLOW_FAULT            fault injection, ACTION@step=N[,rank=R] with ACTION kill | term |
                            exit=CODE | raise, or kill@save[=K][,rank=R] | kill@time=SECONDS[,rank=R]
                            (unsynchronised; see docs/trainer.md); honoured only with
  GANGFLOW_ALLOW_FAULTS=1   (otherwise ignored with a warning)
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL(_S3)   S3 run dirs and DVC remotes
  TMPDIR                    rank-local scratch (the fetched dataset version)
  GANGFLOW_TERMINATION_LOG  where to write the Kubernetes termination message
                            (default /dev/termination-log when it exists)
  GANGFLOW_LOG_FORMAT       text (default) or json: every line of the rank as one JSON object with
                            rank, gang, dag_id, dag_run_id, pipeline, mlflow_run_id (from
                            GANGFLOW_GANG, GANGFLOW_DAG_ID, GANGFLOW_DAG_RUN_ID, GANGFLOW_PIPELINE,
                            MLFLOW_RUN_ID or GANGFLOW_MLFLOW_RUN_ID)
  GANGFLOW_METRICS_PORT     rank 0 serves Prometheus metrics on this port (Kubernetes pods)
  MLFLOW_TRACKING_URI       MLflow tracking URI (when tracking.mlflow_uri is empty)
  MLFLOW_RUN_ID             log into this existing MLflow run
  TORCHELASTIC_ERROR_FILE   set by torchrun: the error file written on an exception
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT   set by torchrun
  OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK                       set by mpirun (with MASTER_ADDR/PORT)

examples:
  python -m trainer --run-dir runs/one --set train.max_steps=100
  torchrun --standalone --nproc-per-node 2 -m trainer --run-dir runs/two --config params.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train one rank of a gangflow gang (DDP). Resumes from the newest committed "
        "checkpoint in --run-dir when there is one.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", required=True, metavar="DIR",
                        help="run folder, a local path or an fsspec URL (s3://bucket/prefix/run, gs://..., "
                        "file:///...): checkpoints/, metrics.jsonl, final/, errors/ (created if missing)")
    parser.add_argument("--config", type=Path, metavar="PARAMS_YAML",
                        help="params file (default: ./params.yaml when it exists, else built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one parameter, repeatable; string parameters keep the text exactly, others are "
                        "parsed as YAML (true, 0.1, [1, 2])")
    parser.add_argument("--print-config", action="store_true",
                        help="validate, print the resolved config as JSON and exit without training")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.config is None and Path("params.yaml").is_file():
        args.config = Path("params.yaml")
    return args
