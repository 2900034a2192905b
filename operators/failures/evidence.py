"""Typed evidence: what a backend collected when a gang failed (contract 4), parsed tolerantly.

`Evidence.parse(mapping)` never raises: unknown keys and ill-typed values are ignored, and every
size is bounded (texts, lists, nesting depth, integers: a >4300-digit int cannot even be printed),
so a hostile or broken termination message costs bounded time and memory.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.failure_catalogue import is_library_path

__all__ = ["Condition", "ErrorRecord", "Event", "Evidence", "Exc"]

# Bounds. The cause of a failure is at the end of a log: the tail is kept.
MAX_LOG = 64 * 1024
MAX_TEXT = 8 * 1024
MAX_ITEMS = 256  # events, conditions, ranks
# Matching cost grows with the text: with `ranks`, all ranks' logs share one budget (each rank
# keeps the tail of its log, at least RANK_LOG_MIN), and a line longer than MAX_LINE keeps its
# head (an exception's type and message start there) and its tail (an errno's words end it).
GANG_LOG_BUDGET = 128 * 1024
RANK_LOG_MIN = 512
MAX_LINE = 1024
LINE_HEAD, LINE_TAIL = 512, 128
MAX_EVENT_TEXT = 1024  # the API server keeps an event's message to 1 KiB as well
MAX_RANK_ITEMS = 16  # events and conditions inside one rank's entry
MAX_DEPTH = 8  # nesting of lists inside a text field
MAX_INT = 2**63  # larger "exit codes" are noise

SIGNALS = {
    "SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGBUS": 7,
    "SIGFPE": 8, "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13,
    "SIGALRM": 14, "SIGTERM": 15,
}  # fmt: skip
SIGNAL_NAMES = {v: k for k, v in SIGNALS.items()}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RANK_PREFIX = re.compile(r"^\[(?:rank|default)?(\d+)\]:\s?")
# torchrun's own summary of the first failed worker: the worker's exit code or signal.
LAUNCHER_EXIT = re.compile(r"failed \(exitcode: (-?\d{1,6})\) local_rank: (\d{1,6})")
# Open MPI's (mpirun/prterun) summary of the first failed rank: killed by a signal, or a non-zero exit.
MPIRUN_SIGNAL = re.compile(r"(?:mpirun|prterun) noticed that process rank (\d{1,6}) with PID \d+ on node \S+ exited on\s+signal (\d{1,3})")
MPIRUN_EXIT = re.compile(r"(?:mpirun|prterun) detected that one or more processes exited with non-zero status.*?"
                         r"Process name:\s*\[[^\]]*?,(\d{1,6})\]+\s+Exit code:\s+(-?\d{1,6})", re.DOTALL)


# mpirun --tag-output: "[JOB,RANK]<stdout>: text"
MPI_RANK_LINE = re.compile(r"^\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>: ?(.*)$")


def mpirun_launcher_evidence(log: str, tail_lines: int = 60) -> dict | None:
    """From an mpirun launcher's whole output (an MPIJob's launcher pod): the rank its summary
    names first, with that rank's own lines as `log_tail`, or None. The other ranks' lines, e.g. a
    peer's "Connection reset by peer" after the kill, are not this rank's evidence."""
    first = parse_mpirun_failure(log)
    if first is None:
        return None
    own = [m.group(2) for line in log.splitlines() if (m := MPI_RANK_LINE.match(line)) and int(m.group(1)) == first["rank"]]
    return {**first, "log_tail": "\n".join(own[-tail_lines:])}


def parse_mpirun_failure(output: str) -> dict | None:
    """The first failed rank of Open MPI's summary (`{rank, signal}` or `{rank, exit_code}`), or None."""
    if m := MPIRUN_SIGNAL.search(output):
        number = int(m.group(2))
        return {"rank": int(m.group(1)), "exit_code": -number, "signal": SIGNAL_NAMES.get(number, str(number))}
    if m := MPIRUN_EXIT.search(output):
        return {"rank": int(m.group(1)), "exit_code": int(m.group(2))}
    return None


# Ray's own failure types, on its side of a worker (the worker, its node or the object store died);
# a rank's `RankExitError` only says that the trainer ended with a code (its error record says why).
RAY_SYSTEM_FAILURES = ("ActorDiedError", "RayActorError", "WorkerCrashedError", "NodeDiedError", "OwnerDiedError",
                       "ObjectLostError", "ObjectStoreFullError", "OutOfMemoryError", "ActorUnavailableError",
                       "RaySystemError", "WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError")  # fmt: skip
_RANK_EXIT = re.compile(r"rank (\d{1,6}): the trainer exited with code (-?\d{1,6})")


def ray_evidence(result: Mapping, exit_code: int, driver_text: str, rank_tails: Mapping, records: Mapping) -> dict:
    """Classifier evidence (contract 4) from a Ray Train run (operators.backends.ray): one item per
    failed worker (Ray's exception, its traceback, the rank's output and the error record it wrote
    this try); first the rank where Ray itself saw the failure (a worker, node or object store died),
    else the rank whose record blames the user's code, else the lowest. Without a per-worker failure
    (the cluster never started, the driver was killed) the driver's own output is the evidence."""
    failures = result.get("worker_failures") if isinstance(result, Mapping) else None
    failures = failures if isinstance(failures, Mapping) else {}
    ranks, ray_system = [], {}
    for key, failure in failures.items():
        rank = integer(key)
        if rank is None or not isinstance(failure, Mapping):
            continue
        kind = text(failure.get("type"), 200).rsplit(".", 1)[-1]
        item: dict[str, Any] = {"rank": rank}
        ray_system[rank] = kind in RAY_SYSTEM_FAILURES
        tail = "\n".join(text(line) for line in rank_tails.get(rank, ()))
        item["log_tail"] = "\n".join(filter(None, [tail, text(failure.get("traceback"), MAX_LOG, tail=True)]))
        if m := _RANK_EXIT.search(text(failure.get("message"))):
            item["exit_code"] = int(m.group(2))
        if rank in records:
            item["error_file"] = records[rank]
        ranks.append(item)
    if not ranks:
        error = result.get("error") if isinstance(result, Mapping) else None
        if not isinstance(error, Mapping):
            return {"exit_code": exit_code, "log_tail": driver_text[-6000:]}
        # The driver's own failure (the cluster did not start, Ray Train could not place the
        # workers): gangflow's and Ray's code, not the user's (`source: null`, as the trainer's records say it).
        record = {"exc_type": text(error.get("type"), 200), "message": text(error.get("message")), "source": None,
                  "traceback": text(error.get("traceback"), MAX_LOG, tail=True)}  # fmt: skip
        return {"exit_code": exit_code, "log_tail": driver_text[-6000:], "error_file": record}

    def order(item: dict) -> tuple:
        record = item.get("error_file") if isinstance(item.get("error_file"), Mapping) else {}
        return (not ray_system[item["rank"]], record.get("source") != "user", item["rank"])

    ranks.sort(key=order)
    return {**ranks[0], "ranks": ranks}


# --- a Ray driver's output (the local ray backend's driver, a RayJob's job message) ------------

RESULT_PREFIX = "gangflow-ray-result: "  # the driver's last line: its result as JSON
RAY_TAIL_LINES = 60  # each worker's last lines kept as its evidence
# "gangflow: ray worker rank R pid P": how a worker's output is mapped to its rank.
_WORKER_HELLO = re.compile(r"gangflow: ray worker rank (\d+) pid (\d+)")
# Ray's prefix of a worker process's forwarded output: "(RayTrainWorker pid=123, ip=127.0.0.1) text".
_WORKER_LINE = re.compile(r"^\((?:[\w.]+ )?pid=(\d+)(?:, ip=[^)]*)?\)\s?(.*)$")
_RESUMED = re.compile(r"gangflow: resuming from checkpoint step-(\d+)")


class DriverOutput:
    """What the driver printed, line by line: each worker's lines by rank (Ray prefixes them with
    the worker's pid; the worker's first line names its rank), the driver's and Ray's own, the result."""

    def __init__(self) -> None:
        self.pid_rank: dict[int, int] = {}
        self.rank_tails: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=RAY_TAIL_LINES))
        self.driver_lines: collections.deque = collections.deque(maxlen=400)
        self.resumed_from: int | None = None
        self.result: dict | None = None

    def feed(self, raw: str) -> tuple[int | None, str | None]:
        """(rank, text) of a worker's line, (None, text) of any other, (None, None) of the result line."""
        line = _ANSI.sub("", raw.rstrip("\n"))
        if line.startswith(RESULT_PREFIX):
            try:
                self.result = json.loads(line[len(RESULT_PREFIX):])
                return None, None
            except ValueError:
                pass
        m = _WORKER_LINE.match(line)
        if m and (hello := _WORKER_HELLO.search(m.group(2))):
            self.pid_rank[int(hello.group(2))] = int(hello.group(1))
        rank = self.pid_rank.get(int(m.group(1))) if m else None
        if rank is None:
            self.driver_lines.append(line)
            return None, line
        text = m.group(2)
        self.rank_tails[rank].append(text)
        if self.resumed_from is None and (r := _RESUMED.search(text)):
            self.resumed_from = int(r.group(1))
        return rank, text

    def evidence(self, exit_code: int, records: dict[int, dict]) -> dict:
        return ray_evidence(self.result or {}, exit_code, "\n".join(self.driver_lines), dict(self.rank_tails), records)


# Ray's message of a failed job (the job manager's; KubeRay copies it into a RayJob's `message`)
_JOB_FAILED = re.compile(r"Job entrypoint command failed with exit code (-?\d+), last available logs[^\n]*:\n")


def job_message_evidence(message: str) -> dict | None:
    """Evidence from a failed Ray job's message, which ends with the driver's own output (a RayJob's
    `AppFailed`): judged as this backend judges its driver's output, or None when it is not one."""
    m = _JOB_FAILED.search(message or "")
    if m is None:
        return None
    output = DriverOutput()
    for line in message[m.end() :].splitlines():
        output.feed(line)
    return output.evidence(int(m.group(1)), {})


def text(value: Any, limit: int = MAX_TEXT, *, tail: bool = False) -> str:
    """A string from a string (or a list of strings, as some log collectors send), bounded."""
    parts: list[str] = []
    size = 0

    def walk(v: Any, depth: int) -> None:
        nonlocal size
        if size > limit or v is None:
            return
        if isinstance(v, str):
            piece = v
        elif isinstance(v, (list, tuple)):
            if depth < MAX_DEPTH:
                for item in (v[-MAX_ITEMS * 16 :] if tail else v[: MAX_ITEMS * 16]):
                    walk(item, depth + 1)
            return
        elif isinstance(v, bool) or isinstance(v, float):
            piece = str(v)
        elif isinstance(v, int):
            piece = str(v) if -MAX_INT < v < MAX_INT else ""
        else:
            return  # dicts and other objects are not text
        parts.append(piece)
        size += len(piece)

    walk(value, 0)
    joined = "".join(parts)
    # Long lines are cut before the tail is taken, so that a rank's last line keeps its head.
    joined = cut_long_lines(joined[-MAX_LOG:] if tail else joined[:MAX_LOG])
    joined = joined[-limit:] if tail else joined[:limit]
    return _ANSI.sub("", joined)


def cut_long_lines(value: str) -> str:
    """Each line longer than MAX_LINE cut to its head and tail (a 64 KiB base64 line: 1 KiB)."""
    if len(value) <= MAX_LINE:
        return value
    lines = value.split("\n")
    if all(len(line) <= MAX_LINE for line in lines):
        return value
    return "\n".join(
        line if len(line) <= MAX_LINE else f"{line[:LINE_HEAD]} … {line[-LINE_TAIL:]}" for line in lines
    )


def integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if -MAX_INT < value < MAX_INT else None
    if isinstance(value, float) and value.is_integer() and abs(value) < MAX_INT:
        return int(value)
    if isinstance(value, str) and len(value) <= 24 and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def signal_number(value: Any) -> int | None:
    number = integer(value)
    if number is not None:
        return abs(number) if 0 < abs(number) < 128 else None
    if isinstance(value, str) and len(value) < 32:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        return SIGNALS.get(name)
    return None


def one_line(value: str, limit: int = 160, focus: str = "") -> str:
    """`value` on one line, at most `limit` chars, cut so that `focus` (if found) stays visible."""
    value = " ".join(value.split())
    if len(value) <= limit:
        return value
    at = value.find(" ".join(focus.split())) if focus else -1
    if at + len(focus) > limit - 1:
        start = max(0, min(at - limit // 3, len(value) - limit + 1))
        value = "…" + value[start + 1 :]
    return value if len(value) <= limit else value[: limit - 1].rstrip() + "…"


@dataclass
class Exc:
    """One exception as printed at the end of a traceback, or as an error record's message."""

    type: str  # as printed: "ValueError", "torch.OutOfMemoryError"
    message: str
    frames: list[str] = field(default_factory=list)  # 'path:line' of each frame, innermost last
    rank: int | None = None
    chain: list[Exc] = field(default_factory=list)  # earlier exceptions of the same chain
    code: str | None = None  # the source line of the innermost frame, when the traceback shows it

    @property
    def name(self) -> str:
        return self.type.rsplit(".", 1)[-1]

    @property
    def text(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type

    def all(self) -> list[Exc]:
        return [*self.chain, self]

    @property
    def raised_by_user(self) -> bool | None:
        """Whether user code raised it: innermost frame outside libraries, a raise/assert line.

        None when there is no traceback to tell (a bare exception line)."""
        if not self.frames:
            return None
        if is_library_path(self.frames[-1].rsplit(":", 1)[0]):
            return False
        return self.code is None or self.code.startswith(("raise", "assert"))

    def user_frame(self) -> str | None:
        """The innermost frame of the exception (or its chain) that is not library code."""
        for one in reversed(self.all()):
            for frame in reversed(one.frames):
                if not is_library_path(frame.rsplit(":", 1)[0]):
                    return frame
        return None


@dataclass
class ErrorRecord:
    """The error file: TorchElastic's format plus gangflow's trainer fields."""

    exc: Exc | None
    rank: int | None
    step: int | None
    source: str | None  # "user" | "config" (gangflow trainer) or None
    callstack: str
    source_given: bool = False  # the trainer wrote `source` (null: "not the user's code")


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    reason: str
    message: str


@dataclass
class Evidence:
    """Contract 4's evidence, typed. Build it with `Evidence.parse`; it never raises."""

    exit_code: int | None = None
    signal: int | None = None
    termination_reason: str = ""
    pod_phase: str = ""
    pod_reason: str = ""
    pod_message: str = ""
    conditions: list[Condition] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    log_tail: str = ""
    record: ErrorRecord | None = None
    tracebacks: list[Exc] = field(default_factory=list)
    rank: int | None = None
    step: int | None = None
    ranks: list[Evidence] = field(default_factory=list)
    launcher_signal: int | None = None  # from torchrun's "failed (exitcode: -9) local_rank: R" or mpirun's summary
    launcher_rank: int | None = None
    launcher_line: str = ""  # the launcher's line that says so

    @classmethod
    def parse(cls, ev: Any, *, nested: bool = False, log_limit: int = MAX_LOG) -> Evidence:
        if not isinstance(ev, Mapping):
            return cls()
        record = _parse_record(ev.get("error_file"), log_limit)
        log_tail = text(ev.get("log_tail"), log_limit, tail=True)
        tracebacks = parse_tracebacks(log_tail)
        if record is not None and record.callstack and "Traceback" in record.callstack:
            tracebacks += parse_tracebacks(record.callstack)
        exit_code = integer(ev.get("exit_code"))
        signal = signal_number(ev.get("signal"))
        if signal is None and exit_code is not None:
            if -128 < exit_code < 0:
                signal = -exit_code
            elif 128 < exit_code <= 128 + 64:
                signal = exit_code - 128
        launcher_signal = launcher_rank = None
        launcher_line = ""
        launcher = LAUNCHER_EXIT.search(log_tail)
        if launcher and int(launcher.group(1)) < 0:
            launcher_signal, launcher_rank = -int(launcher.group(1)), int(launcher.group(2))
            launcher_line = f"torchrun: local_rank {launcher_rank} exit code -{launcher_signal}"
        elif mpi := MPIRUN_SIGNAL.search(log_tail):
            launcher_signal, launcher_rank = int(mpi.group(2)), int(mpi.group(1))
            launcher_line = f"mpirun: rank {launcher_rank} exited on signal {launcher_signal}"
        rank = integer(ev.get("rank"))
        if rank is None and record is not None:
            rank = record.rank
        step = integer(ev.get("step"))
        if step is None and record is not None:
            step = record.step
        ranks_value = ev.get("ranks")
        ranks = []
        if not nested and isinstance(ranks_value, list):  # ranks inside a rank are ignored
            entries = [r for r in ranks_value[:MAX_ITEMS] if isinstance(r, Mapping)]
            share = max(RANK_LOG_MIN, min(MAX_LOG, GANG_LOG_BUDGET // max(1, len(entries))))
            ranks = [cls.parse(r, nested=True, log_limit=share) for r in entries]
        items = MAX_RANK_ITEMS if nested else MAX_ITEMS
        return cls(
            exit_code=exit_code,
            signal=signal,
            termination_reason=text(ev.get("termination_reason"), 256).strip(),
            pod_phase=text(ev.get("pod_phase"), 64).strip(),
            pod_reason=text(ev.get("pod_reason"), 256).strip(),
            pod_message=text(ev.get("pod_message")).strip(),
            conditions=[
                Condition(
                    text(c.get("type"), 128), text(c.get("status"), 16), text(c.get("reason"), 256),
                    text(c.get("message"), MAX_EVENT_TEXT),
                )
                for c in _dicts(ev.get("pod_conditions"), items)
            ],
            events=[
                Event(text(e.get("reason"), 256), text(e.get("message"), MAX_EVENT_TEXT))
                for e in _dicts(ev.get("events"), items)
            ],
            log_tail=log_tail,
            record=record,
            tracebacks=tracebacks,
            rank=rank,
            step=step,
            ranks=ranks,
            launcher_signal=launcher_signal,
            launcher_rank=launcher_rank,
            launcher_line=launcher_line,
        )

    @property
    def is_empty(self) -> bool:
        return self == Evidence(rank=self.rank, step=self.step, ranks=self.ranks)

    @property
    def log_texts(self) -> list[str]:
        texts = [self.log_tail]
        if self.record is not None:
            texts.append(self.record.exc.text if self.record.exc else "")
            texts.append(self.record.callstack)
        texts.append(self.pod_message)
        return [t for t in texts if t]

    def event_texts(self, *reasons: str) -> list[tuple[str, str]]:
        wanted = {r.lower() for r in reasons}
        return [(e.reason, e.message) for e in self.events if not wanted or e.reason.lower() in wanted]

    @property
    def all_text(self) -> str:
        """Everything textual, for similarity search."""
        parts = [self.termination_reason, self.pod_reason, self.pod_message, self.log_tail]
        parts += [f"{c.type} {c.reason} {c.message}" for c in self.conditions]
        parts += [f"{e.reason} {e.message}" for e in self.events]
        if self.record is not None:
            parts += [self.record.exc.text if self.record.exc else "", self.record.callstack]
        parts += [r.all_text for r in self.ranks]
        return "\n".join(p for p in parts if p)


def _dicts(value: Any, limit: int = MAX_ITEMS) -> list[Mapping]:
    return [v for v in value[:limit] if isinstance(v, Mapping)] if isinstance(value, list) else []


def parse_exception_line(line: str) -> tuple[str, str] | None:
    if not line or line[:1].isspace() or len(line) > 4 * MAX_TEXT:
        return None
    match = re.match(r"^([A-Za-z_][\w.]{0,200})(?::\s?(.*))?$", line.strip())
    if not match:
        return None
    exc_type = match.group(1)
    if not (exc_type[:1].isupper() or "." in exc_type):
        return None
    return exc_type, (match.group(2) or "").strip()


def _split_by_rank(value: str) -> dict[int | None, list[str]]:
    streams: dict[int | None, list[str]] = {}
    for raw in value.splitlines():
        match = RANK_PREFIX.match(raw)
        rank = int(match.group(1)) if match else None
        streams.setdefault(rank, []).append(raw[match.end() :] if match else raw)
    return streams


_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+)')


def parse_tracebacks(value: str) -> list[Exc]:
    """Every Python traceback in `value`, chained ones folded into the last of their chain."""
    found: list[Exc] = []
    for rank, lines in _split_by_rank(value).items():
        pending_chain: list[Exc] = []
        i = 0
        while i < len(lines):
            if lines[i].strip() != "Traceback (most recent call last):":
                i += 1
                continue
            frames: list[str] = []
            code: str | None = None
            i += 1
            exc: Exc | None = None
            while i < len(lines):
                line = lines[i]
                frame = _FRAME.match(line)
                if frame:
                    frames.append(f"{frame.group(1)}:{frame.group(2)}")
                    code = None
                elif line[:1].isspace() and line.strip() and frames and code is None:
                    code = line.strip()  # the source line under the innermost frame seen so far
                elif line.strip() and not line[:1].isspace():
                    parsed = parse_exception_line(line)
                    if parsed:
                        message = parsed[1]
                        # Multi-line messages (NCCL errors): keep following unindented lines.
                        j = i + 1
                        while j < len(lines) and j <= i + 3 and lines[j].strip() and not lines[j][:1].isspace():
                            if lines[j].startswith(("Traceback", "During handling", "The above exception")):
                                break
                            message += " " + lines[j].strip()
                            j += 1
                        exc = Exc(parsed[0], message, frames, rank, code=code)
                        i = j - 1
                    break
                i += 1
            i += 1
            if exc is None:
                continue
            # Is the next non-blank line a chaining sentence? Then this exception continues.
            k = i
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k < len(lines) and lines[k].strip().startswith(("During handling of the above", "The above exception")):
                pending_chain.append(exc)
                continue
            exc.chain = pending_chain
            pending_chain = []
            found.append(exc)
        found.extend(pending_chain)
    return found


def _parse_record(value: Any, log_limit: int = MAX_LOG) -> ErrorRecord | None:
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        raw = value[:MAX_LOG]
        try:
            value = json.loads(raw, parse_int=_bounded_int)
        except (ValueError, RecursionError):
            value = {"message": raw}
    if not isinstance(value, Mapping):
        return None
    outer = value
    message = outer.get("message")
    inner = message if isinstance(message, Mapping) else {}
    body = text(inner.get("message") if inner else message)
    extra = inner.get("extraInfo") or outer.get("extraInfo") or {}
    extra = extra if isinstance(extra, Mapping) else {}
    sources = (outer, inner, extra)

    def pick(key: str) -> Any:
        for source in sources:
            if key in source:
                return source[key]
        return None

    # TorchElastic keeps the stack in extraInfo.py_callstack; the trainer's own record
    # (DIR/errors/rank-R.json, the Kubernetes termination message) in `traceback`.
    callstack = text(extra.get("py_callstack") or pick("traceback"), log_limit, tail=True)

    exc_type = text(pick("exc_type"), 200).strip()
    exc: Exc | None = None
    first, _, rest = body.strip().partition("\n")
    parsed = parse_exception_line(first) if first else None
    if exc_type:
        msg = body.strip()
        if msg.startswith(exc_type + ":"):
            msg = msg[len(exc_type) + 1 :].strip()
        exc = Exc(exc_type, one_line(msg, 400))
    elif parsed:
        exc = Exc(parsed[0], one_line(parsed[1] + " " + rest, 400))
    elif body.strip():
        exc = Exc("Error", one_line(body, 400))
    if exc is not None and callstack:
        exc.frames = [f"{m.group(1)}:{m.group(2)}" for m in re.finditer(r'File "([^"]+)", line (\d+)', callstack)]
        stack = parse_tracebacks(callstack) if "Traceback" in callstack else []
        if stack and stack[-1].frames == exc.frames[-len(stack[-1].frames) :]:
            exc.code = stack[-1].code
            exc.chain = stack[-1].chain  # `raise ... from exc`: the causes are judged as a raw log's are
    source = text(pick("source"), 32).strip().lower() or None
    given = any("source" in d for d in sources)
    return ErrorRecord(exc, integer(pick("rank")), integer(pick("step")), source, callstack, given)


def _bounded_int(digits: str) -> int | None:
    """json's parse_int: a number too long to be an exit code, rank or step is dropped."""
    return int(digits) if len(digits) <= 24 else None
