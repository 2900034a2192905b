"""How cost grows with the work (issue 26 item 5): each figure at several sizes, beside the limit it
can approach, measured side by side in one run. The last line is one JSON object.

* checkpoint save, blocked (the loop's stall) and total (snapshot to commit), of a model of about
  0.03M, 1M, 10M and 100M float32 parameters plus SGD momentum, through the trainer's
  `Checkpointer` (writer process, atomic commit), against `torch.save` of the same tensors to the
  same disk (with fsync) and against the disk's write bandwidth measured with the same bytes
  (plain writes + fsync). Restore (`Checkpointer.read`: verify sha256 and load) against `torch.load`
  and a plain read of the bytes (page cache warm on both sides: this measures the code, not the disk).
* dataset fetch + md5 verification (`trainer.datastore.fetch_dataset`) of a 10 MB, 100 MB and 1 GB
  version from a local DVC remote and from an S3-API one (moto's server on 127.0.0.1), against
  reading the same bytes and hashing them with hashlib.
* validation of 10k, 100k and 1M rows by the digits Great Expectations suite, against the same
  checks in pandas (benchmarks/validation.py's `pandas_checks`).
* launch to first step (the trainer's `first_step.startup_s`) for world sizes 1, 2 and 4.

For every figure it says how it grows with the size (the log-log slope: constant < 0.3 <= linear
< 1.3 <= worse) and where the ratio to the limit is largest. Goals: checkpoint save within 1.5x of
the disk's bandwidth at 100M parameters, fetch+verify within 1.3x of read+hash at 1 GB, validation
within 5x of pandas at 1M rows.

    python benchmarks/scale.py                 # all sizes: several minutes and ~5 GB of disk traffic
    python benchmarks/scale.py --tiny          # smallest sizes only (what the unit test runs)
    python benchmarks/scale.py --s3-max-mb 100 # the largest version the S3-API side fetches
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, ROOT, clean_env, note, summary  # noqa: E402

sys.path.insert(0, str(ROOT))

PARAMS = {"0.03m": 30_000, "1m": 1_000_000, "10m": 10_000_000, "100m": 100_000_000}
DATASETS_MB = {"10mb": 10, "100mb": 100, "1g": 1024}
ROWS = {"10k": 10_000, "100k": 100_000, "1m": 1_000_000}
WORLD_SIZES = (1, 2, 4)
GOALS = {"checkpoint_save_over_disk_bandwidth_100m": 1.5, "fetch_verify_over_read_hash_1g": 1.3, "validation_over_pandas_1m": 5.0}


def growth(sizes: list[float], times: list[float]) -> dict:
    """The log-log slope of time over size and what it says."""
    xs, ys = [math.log(s) for s in sizes], [math.log(max(t, 1e-9)) for t in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    word = "constant" if slope < 0.3 else "linear" if slope < 1.3 else "worse than linear"
    return {"slope": round(slope, 2), "grows": word}


def _fsync_write(path: Path, parts: list[bytes | memoryview]) -> None:
    with open(path, "wb") as fh:
        for part in parts:
            fh.write(part)
        fh.flush()
        os.fsync(fh.fileno())


# --- checkpoints ---------------------------------------------------------------------------------

def _state(n_params: int):
    import torch

    from trainer.checkpoint import Snapshot

    # a stack of square-ish layers of about n_params parameters, and SGD momentum for each
    width = max(16, int(math.sqrt(n_params / 4)))
    layers = max(1, n_params // (width * width))
    model = {f"layer{i}.weight": torch.randn(width, width) for i in range(layers)}
    model["head.bias"] = torch.randn(max(1, n_params - layers * width * width))
    optimizer = {f"{i}/momentum_buffer": t.clone() for i, t in enumerate(model.values())}
    state = {"step": 1, "config": {}, "optimizer": {"param_groups": [], "state": {}}}
    return Snapshot(1, model, optimizer, state), model, optimizer


def bench_checkpoints(names: list[str], reps: int, tmp: Path) -> dict:
    import torch

    from trainer.checkpoint import Checkpointer, encode
    from trainer.config import CheckpointConfig

    out = {}
    for name in names:
        snap, model, optimizer = _state(PARAMS[name])
        parts = [p for buffers in encode(snap).values() for p in buffers]
        nbytes = sum(len(p) for p in parts)
        rows = {"gangflow_total": [], "gangflow_blocked": [], "torch_save": [], "disk_write": [],
                "gangflow_restore": [], "torch_load": [], "disk_read": []}
        root = tmp / f"ckpt-{name}"
        # one Checkpointer per size, its writer process up before the timed saves (as in training,
        # where it starts beside the resume, long before the first save): a warm-up save first
        ck = Checkpointer(root, CheckpointConfig(keep_last=2), rank=0, log=lambda m: None)
        ck.start_writer()
        ck.save(_state(1000)[0])
        ck.wait()
        for rep in range(reps):
            arms = ["gangflow", "torch", "disk"] if rep % 2 == 0 else ["disk", "torch", "gangflow"]
            for arm in arms:
                if arm == "gangflow":
                    snap.step = snap.state["step"] = rep + 2
                    t0 = time.perf_counter()
                    ck.save(snap)
                    blocked = time.perf_counter() - t0
                    ck.wait()
                    rows["gangflow_total"].append(time.perf_counter() - t0)
                    rows["gangflow_blocked"].append(blocked)
                elif arm == "torch":
                    t0 = time.perf_counter()
                    with open(tmp / f"torch-{name}.pt", "wb") as fh:
                        torch.save({"model": model, "optimizer": optimizer}, fh)
                        fh.flush()
                        os.fsync(fh.fileno())
                    rows["torch_save"].append(time.perf_counter() - t0)
                else:
                    t0 = time.perf_counter()
                    _fsync_write(tmp / f"raw-{name}.bin", parts)
                    rows["disk_write"].append(time.perf_counter() - t0)
            for arm in (["gangflow", "torch", "disk"] if rep % 2 == 0 else ["disk", "torch", "gangflow"]):
                t0 = time.perf_counter()
                if arm == "gangflow":
                    ck.read(rep + 2)
                    rows["gangflow_restore"].append(time.perf_counter() - t0)
                elif arm == "torch":
                    torch.load(tmp / f"torch-{name}.pt", weights_only=True)
                    rows["torch_load"].append(time.perf_counter() - t0)
                else:
                    (tmp / f"raw-{name}.bin").read_bytes()
                    rows["disk_read"].append(time.perf_counter() - t0)
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
        for f in tmp.glob(f"*-{name}.*"):
            f.unlink()
        med = {k: statistics.median(v) for k, v in rows.items()}
        out[name] = {"params": PARAMS[name], "bytes": nbytes, "seconds": {k: summary(v, 4) for k, v in rows.items()},
                     "save_over_disk": round(med["gangflow_total"] / med["disk_write"], 3),
                     "save_over_torch_save": round(med["gangflow_total"] / med["torch_save"], 3),
                     "blocked_over_total": round(med["gangflow_blocked"] / med["gangflow_total"], 4),
                     "restore_over_read": round(med["gangflow_restore"] / med["disk_read"], 3),
                     "restore_over_torch_load": round(med["gangflow_restore"] / med["torch_load"], 3),
                     "disk_write_mb_s": round(nbytes / med["disk_write"] / 1e6, 1)}
        note(f"checkpoint {name}: {nbytes / 1e6:.1f} MB, save {med['gangflow_total']:.3f}s (blocked {med['gangflow_blocked']:.4f}s), "
             f"torch.save {med['torch_save']:.3f}s, disk {med['disk_write']:.3f}s; restore {med['gangflow_restore']:.3f}s, "
             f"torch.load {med['torch_load']:.3f}s, read {med['disk_read']:.3f}s")
    return out


# --- dataset fetch ---------------------------------------------------------------------------------

def _make_remote(root: Path, mb: int) -> tuple[str, Path]:
    """A DVC-layout remote under `root` holding one version: train.parquet of `mb` MB (random bytes)
    and a small test.parquet. Returns (version md5, the big object's path)."""
    files = {}
    chunk = os.urandom(1 << 20)
    big = root / "tmp-train"
    big.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.md5()
    with open(big, "wb") as fh:
        for i in range(mb):
            block = chunk[i % 256:] + chunk[: i % 256]  # distinct blocks, no compression shortcut
            fh.write(block)
            digest.update(block)
    files["train.parquet"] = (big, digest.hexdigest())
    small = root / "tmp-test"
    small.write_bytes(b"test" * 1000)
    files["test.parquet"] = (small, hashlib.md5(small.read_bytes()).hexdigest())
    listing = []
    for relpath, (path, md5) in files.items():
        target = root / "files" / "md5" / md5[:2] / md5[2:]
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        listing.append({"md5": md5, "relpath": relpath})
    from trainer.datastore import listing_digest, object_path

    version = listing_digest(listing)
    target = Path(object_path(str(root), version, ".dir"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(json.dumps(sorted(listing, key=lambda e: e["relpath"])).encode())
    return version, root / "files" / "md5" / files["train.parquet"][1][:2] / files["train.parquet"][1][2:]


def _read_hash(paths: list[Path]) -> None:
    for path in paths:
        digest = hashlib.md5()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)


def _start_moto(tmp: Path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp / "moto.log", "w")
    proc = subprocess.Popen([str(Path(PY).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(200):
        try:
            urllib.request.urlopen(url, timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not start: {(tmp / 'moto.log').read_text()[-2000:]}")


def bench_fetch(names: list[str], reps: int, tmp: Path, s3_max_mb: int) -> dict:
    from trainer.datastore import fetch_dataset

    out = {}
    moto = None
    try:
        for name in names:
            mb = DATASETS_MB[name]
            remote_root = tmp / f"remote-{name}"
            version, big = _make_remote(remote_root, mb)
            objects = [p for p in (remote_root / "files").rglob("*") if p.is_file() and not p.name.endswith(".dir")]
            remotes = {"local": remote_root.as_uri()}
            if mb <= s3_max_mb:
                import boto3

                if moto is None:
                    moto = _start_moto(tmp)
                    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                                      AWS_ENDPOINT_URL=moto[1], AWS_ENDPOINT_URL_S3=moto[1])
                s3 = boto3.client("s3", endpoint_url=moto[1])
                bucket = f"bench-{name}".replace(".", "-")
                s3.create_bucket(Bucket=bucket)
                for path in remote_root.rglob("*"):
                    if path.is_file():
                        s3.upload_file(str(path), bucket, f"dvc/{path.relative_to(remote_root)}")
                remotes["s3"] = f"s3://{bucket}/dvc"
            rows: dict[str, list[float]] = {"read_hash": [], **{f"fetch_{k}": [] for k in remotes}}
            for rep in range(reps):
                arms = ["read_hash", *[f"fetch_{k}" for k in remotes]]
                for arm in arms if rep % 2 == 0 else arms[::-1]:
                    dest = tmp / f"fetched-{name}-{arm}-{rep}"
                    t0 = time.perf_counter()
                    if arm == "read_hash":
                        _read_hash(objects)
                    else:
                        fetch_dataset(remotes[arm.removeprefix("fetch_")], version, dest)
                    rows[arm].append(time.perf_counter() - t0)
                    shutil.rmtree(dest, ignore_errors=True)
            med = {k: statistics.median(v) for k, v in rows.items()}
            out[name] = {"mb": mb, "seconds": {k: summary(v, 4) for k, v in rows.items()},
                         **{f"{k}_over_read_hash": round(med[k] / med["read_hash"], 3) for k in rows if k != "read_hash"}}
            note(f"fetch {name}: read+hash {med['read_hash']:.3f}s, " + ", ".join(f"{k} {med[k]:.3f}s" for k in rows if k != "read_hash"))
            shutil.rmtree(remote_root, ignore_errors=True)
    finally:
        if moto is not None:
            moto[0].terminate()
            moto[0].wait(30)
    return out


# --- validation ------------------------------------------------------------------------------------

def bench_validation(names: list[str], reps: int, tmp: Path) -> dict:
    import logging

    import pandas as pd

    from data import expectations as e
    from operators.validation import run_expectations
    from validation import pandas_checks

    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    out = {}
    for name in names:
        folder = tmp / f"synthetic-{name}"
        subprocess.run([PY, "data/prepare.py", "--synthetic", str(ROWS[name]), "--out", str(folder)], cwd=ROOT, check=True,
                       capture_output=True)
        frames = {s: pd.read_parquet(folder / f"{s}.parquet") for s in ("train", "test")}
        bands = {s: (len(f), len(f)) for s, f in frames.items()}

        def suite(split: str):
            return e.digits_suite(split, row_count=bands[split])

        run_expectations(frames, suite)  # warm-up: GX import and metric registration
        gx, pdx = [], []
        for rep in range(reps):
            for arm in (("gx", "pandas") if rep % 2 == 0 else ("pandas", "gx")):
                t0 = time.perf_counter()
                if arm == "gx":
                    assert run_expectations(frames, suite).success
                    gx.append(time.perf_counter() - t0)
                else:
                    assert not pandas_checks(frames, bands)
                    pdx.append(time.perf_counter() - t0)
        out[name] = {"rows": sum(len(f) for f in frames.values()), "seconds": {"gx": summary(gx, 4), "pandas": summary(pdx, 4)},
                     "gx_over_pandas": round(statistics.median(g / p for g, p in zip(gx, pdx)), 2)}
        note(f"validation {name}: GX {statistics.median(gx):.3f}s, pandas {statistics.median(pdx):.4f}s")
        shutil.rmtree(folder, ignore_errors=True)
    return out


# --- launch ----------------------------------------------------------------------------------------

def bench_launch(world_sizes: list[int], reps: int, tmp: Path) -> dict:
    digits = ROOT / "data" / "digits"
    if not (digits / "train.parquet").is_file():
        subprocess.run([PY, "data/prepare.py", "--out", "data/digits"], cwd=ROOT, check=True, capture_output=True)
    out = {}
    for n in world_sizes:
        startup = []
        for rep in range(reps):
            run_dir = tmp / f"launch-{n}-{rep}"
            cmd = [PY, "-m", "trainer.launch", "--standalone", "--nproc-per-node", str(n), "--max-restarts", "0",
                   "-m", "trainer", "--run-dir", str(run_dir), "--config", str(ROOT / "params.yaml"),
                   "--set", "train.max_steps=2", "--set", "checkpoint.every_steps=100", "--set", "tracking.progress_every_s=0"]
            done = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"world size {n}: trainer failed:\n{(done.stdout + done.stderr)[-3000:]}")
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
            startup += [r["startup_s"] for r in rows if r.get("event") == "first_step"]
            shutil.rmtree(run_dir, ignore_errors=True)
        out[f"ws{n}"] = {"world_size": n, "launch_to_first_step_s": summary(startup, 3)}
        note(f"launch to first step, world size {n}: {statistics.median(startup):.2f}s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per size (default 3)")
    parser.add_argument("--tiny", action="store_true", help="the smallest size of each figure, one repetition (a smoke run)")
    parser.add_argument("--s3-max-mb", type=int, default=1024, help="largest version fetched from the S3-API remote (default 1024)")
    parser.add_argument("--only", choices=("checkpoint", "fetch", "validation", "launch"), action="append",
                        help="run only these parts (repeatable)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    reps = 1 if args.tiny else args.reps
    params = ["0.03m"] if args.tiny else list(PARAMS)
    datasets = ["10mb"] if args.tiny else list(DATASETS_MB)
    rows = ["10k"] if args.tiny else list(ROWS)
    sizes = [1] if args.tiny else list(WORLD_SIZES)
    parts = set(args.only or ("checkpoint", "fetch", "validation", "launch"))
    result: dict = {"benchmark": "scale", "reps": reps, "tiny": args.tiny}
    with tempfile.TemporaryDirectory(prefix="gangflow-bench-scale-") as tmp_name:
        tmp = Path(tmp_name)
        if "checkpoint" in parts:
            result["checkpoint"] = ck = bench_checkpoints(params, reps, tmp)
            if len(params) > 1:
                result["checkpoint_growth"] = {k: growth([ck[n]["params"] for n in params], [ck[n]["seconds"][k]["median"] for n in params])
                                               for k in ("gangflow_total", "gangflow_blocked", "gangflow_restore", "disk_write")}
            result[f"checkpoint_save_over_disk_bandwidth_{params[-1]}"] = ck[params[-1]]["save_over_disk"]
            result[f"checkpoint_save_over_torch_save_{params[-1]}"] = ck[params[-1]]["save_over_torch_save"]
            result[f"checkpoint_restore_over_read_{params[-1]}"] = ck[params[-1]]["restore_over_read"]
        if "fetch" in parts:
            result["fetch"] = fe = bench_fetch(datasets, reps, tmp, args.s3_max_mb)
            if len(datasets) > 1:
                result["fetch_growth"] = {k: growth([fe[n]["mb"] for n in datasets], [fe[n]["seconds"][k]["median"] for n in datasets])
                                          for k in ("fetch_local", "read_hash")}
            result[f"fetch_verify_over_read_hash_{datasets[-1]}"] = fe[datasets[-1]]["fetch_local_over_read_hash"]
            if "fetch_s3_over_read_hash" in fe[datasets[-1]]:
                result[f"fetch_verify_s3_over_read_hash_{datasets[-1]}"] = fe[datasets[-1]]["fetch_s3_over_read_hash"]
        if "validation" in parts:
            result["validation"] = va = bench_validation(rows, reps, tmp)
            if len(rows) > 1:
                result["validation_growth"] = {k: growth([va[n]["rows"] for n in rows], [va[n]["seconds"][k]["median"] for n in rows])
                                               for k in ("gx", "pandas")}
            result[f"validation_over_pandas_{rows[-1]}"] = va[rows[-1]]["gx_over_pandas"]
        if "launch" in parts:
            result["launch"] = la = bench_launch(sizes, reps, tmp)
            if len(sizes) > 1:
                result["launch_growth"] = growth(sizes, [la[f"ws{n}"]["launch_to_first_step_s"]["median"] for n in sizes])
    result["worst_size"] = worst_sizes(result)
    over = {k: result[k] / goal for k, goal in GOALS.items() if k in result}
    if over:  # the headline figure furthest beyond its goal
        worst = max(over, key=over.get)
        result["largest_gap"] = {"figure": worst, "ratio": result[worst], "goal": GOALS[worst], "over_goal": round(over[worst], 2)}
    result["goals"] = {k: f"<= {v}" for k, v in GOALS.items()}
    result["goals_met"] = {k: result[k] <= v for k, v in GOALS.items() if k in result}
    result["benchmark_seconds"] = round(time.monotonic() - started, 1)
    _table(result)
    print(json.dumps(result), flush=True)
    return 0


def worst_sizes(result: dict) -> dict:
    """Per ratio, the size where it is furthest from its limit."""
    found = {}
    series = {"checkpoint_save_over_disk": ("checkpoint", "save_over_disk"), "checkpoint_restore_over_read": ("checkpoint", "restore_over_read"),
              "fetch_local_over_read_hash": ("fetch", "fetch_local_over_read_hash"), "fetch_s3_over_read_hash": ("fetch", "fetch_s3_over_read_hash"),
              "validation_over_pandas": ("validation", "gx_over_pandas")}
    for name, (part, key) in series.items():
        sizes = {size: data[key] for size, data in result.get(part, {}).items() if key in data}
        if sizes:
            size = max(sizes, key=sizes.get)
            found[name] = {"size": size, "ratio": sizes[size]}
    return found


def _table(result: dict) -> None:
    """The human table (stdout, before the JSON line): per figure its ratio to the limit by size and how it grows."""
    lines = ["figure                              size      ratio to limit   grows"]
    for name, data in result.get("checkpoint", {}).items():
        lines.append(f"checkpoint save / disk write        {name:<8}  {data['save_over_disk']:>8}")
        lines.append(f"checkpoint save / torch.save        {name:<8}  {data['save_over_torch_save']:>8}")
        lines.append(f"checkpoint restore / read           {name:<8}  {data['restore_over_read']:>8}")
    for key, g in result.get("checkpoint_growth", {}).items():
        lines.append(f"checkpoint {key:<24} all       slope {g['slope']:>6}   {g['grows']}")
    for name, data in result.get("fetch", {}).items():
        for k, v in data.items():
            if k.endswith("_over_read_hash"):
                lines.append(f"{k.removesuffix('_over_read_hash'):<10} fetch+md5 / read+hash  {name:<8}  {v:>8}")
    for key, g in result.get("fetch_growth", {}).items():
        lines.append(f"{key:<34}  all       slope {g['slope']:>6}   {g['grows']}")
    for name, data in result.get("validation", {}).items():
        lines.append(f"validation GX / pandas              {name:<8}  {data['gx_over_pandas']:>8}")
    for key, g in result.get("validation_growth", {}).items():
        lines.append(f"validation {key:<24} all       slope {g['slope']:>6}   {g['grows']}")
    for name, data in result.get("launch", {}).items():
        lines.append(f"launch to first step (s)            {name:<8}  {data['launch_to_first_step_s']['median']:>8}")
    if "launch_growth" in result:
        g = result["launch_growth"]
        lines.append(f"launch to first step by world size  all       slope {g['slope']:>6}   {g['grows']}")
    for name, worst in result.get("worst_size", {}).items():
        lines.append(f"largest gap of {name}: at {worst['size']} ({worst['ratio']})")
    if "largest_gap" in result:
        gap = result["largest_gap"]
        lines.append(f"furthest beyond its goal: {gap['figure']} = {gap['ratio']} (goal {gap['goal']}, {gap['over_goal']}x)")
    for k, met in result.get("goals_met", {}).items():
        lines.append(f"goal {k} {result['goals'][k]}: {'met' if met else 'NOT met'} ({result[k]})")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
