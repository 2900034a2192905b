"""Start-up probe for benchmarks/restart.py: phase timestamps from inside a rank, without
changing trainer/.

Python imports `sitecustomize` at start-up from PYTHONPATH. restart.py puts this folder there and
sets GANGFLOW_BENCH_PROBE to a folder; every Python process started under it (torchrun's agent,
each rank) then appends JSON lines `{"pid", "rank", "argv0", "mark", "t"}` (t: epoch seconds) to
`<folder>/<pid>.jsonl`:

* `process_start`: the kernel's start time of this process (/proc, 10 ms resolution); for a
  process forked from a probed one (trainer.launch's ranks), the fork, as is `site`;
* `site`: the interpreter is up (this file runs);
* `import:<module>:begin|end`: executing the modules in IMPORTS (nested imports included);
* `call:<name>:begin|end`: the trainer functions in WRAP (the first call of each only);
* `atexit`: the interpreter is shutting down normally (not after os._exit or a signal).

Without GANGFLOW_BENCH_PROBE this file does nothing. Wrapping is by name and skips anything
missing, so a trainer that moved a function just loses that phase.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_DIR = os.environ.get("GANGFLOW_BENCH_PROBE")

IMPORTS = ("torch", "mlflow", "pyarrow", "numpy", "trainer.loop", "trainer.__main__", "torch.distributed.run", "torch._dynamo",
           "torch._inductor", "sympy", "torch.optim")
# module -> [(attribute path, phase name)]
WRAP = {
    "trainer.cli": [("parse_args", "main")],  # the first thing trainer.__main__.main does
    "trainer.data": [("resolve_data", "data_resolve_md5"), ("parquet_dataset", "data_load")],
    "trainer.distributed": [("setup", "rendezvous")],
    "trainer.checkpoint": [("Checkpointer.select", "checkpoint_select"), ("Checkpointer.read", "checkpoint_load")],
    "trainer.tracking": [("MlflowSink.__init__", "mlflow_connect"), ("Tracker.__init__", "tracker_init")],
    "trainer.models": [("mlp", "model_init")],
    # the Airflow task process (dag.test runs the task in-process)
    "operators.training": [("GangTrainingOperator.execute", "op_execute"), ("GangTrainingOperator.mlflow_run", "op_mlflow_run"),
                           ("GangTrainingOperator._open_run", "op_open_run"), ("GangTrainingOperator._finish", "op_finish")],
    "operators.hooks.mlflow_relay": [("TrackingRelay.finish", "op_relay_finish")],
    "trainer.loop": [("Trainer.__init__", "trainer_init"), ("make_loader", "make_loader"), ("Trainer.resume", "resume"),
                     ("Trainer.train_step", "first_step")],
    "trainer.runtime": [("Session.close", "close")],  # the loop's session: the last commit, the tracker
}


def _emit(mark: str, t: float | None = None) -> None:
    line = json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv0": " ".join(sys.argv[:3])[:200],
                       "mark": mark, "t": time.time() if t is None else t})  # fmt: skip
    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as fh:
        fh.write(line + "\n")


def _process_start() -> float | None:
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        # As trainer.tracking._process_start (the probe imports nothing of the project: it must not
        # change the imports it measures). The boot time from the clocks, not /proc/stat's `btime`:
        # that is whole seconds, which put process_start up to a second early (measured: 0.38-0.41
        # s) and inflated `interpreter_s`.
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def _wrap_once(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None or getattr(fn, "_gangflow_probe", False):
        return
    done = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if done:
            return fn(*args, **kwargs)
        done.append(True)
        _emit(f"call:{name}:begin")
        try:
            return fn(*args, **kwargs)
        finally:
            _emit(f"call:{name}:end")

    wrapper._gangflow_probe = True
    setattr(owner, attr, wrapper)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        timed = self.name in IMPORTS
        if timed:
            _emit(f"import:{self.name}:begin")
        try:
            self.inner.exec_module(module)
        finally:
            if timed:
                _emit(f"import:{self.name}:end")
        for path, phase in WRAP.get(self.name, ()):
            owner, _, attr = path.rpartition(".")
            target = getattr(module, owner, None) if owner else module
            if target is not None:
                _wrap_once(target, attr, phase)

    def __getattr__(self, item):  # get_code, get_source, ... for tools that ask the loader
        return getattr(self.inner, item)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in IMPORTS and name not in WRAP:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, name)
        return spec


if _DIR:
    started = _process_start()
    if started is not None:
        _emit("process_start", started)
    _emit("site")
    sys.meta_path.insert(0, _Finder())
    import atexit

    atexit.register(_emit, "atexit")
    # A rank forked by trainer.launch runs no start-up of its own: it exists, with its modules
    # imported, from the fork (its marks go to its own <pid>.jsonl).
    os.register_at_fork(after_in_child=lambda: (_emit("process_start"), _emit("site")))
