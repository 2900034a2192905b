"""The failure classifier: why did a training gang fail, and is it worth another try?

`classify(evidence) -> Verdict` reads what the backend collected when a gang failed (DESIGN.md
contract 4) and says `infra` (retry: the cluster, a node, the network or storage broke),
`user` (fail now: the code, config, data or resource request is wrong and a retry would
repeat it) or `unknown` (nothing matched; `operators.retry.ClassifiedRetryPolicy` retries it
once, then treats it as user). The same verdict is printed as JSON by

    python -m operators.failures < evidence.json

Evidence keys, all optional: `exit_code`, `signal` (int or a name like "SIGKILL"),
`termination_reason`, `pod_phase`, `pod_reason`, `pod_message`, `pod_conditions`
[{type, reason, message}], `events` [{reason, message}], `log_tail`, `error_file` (the
TorchElastic error-file JSON; gangflow's trainer adds `rank`, `step`, `exc_type` and
`source` = "user" | "config"), plus `rank`/`step` and `ranks` ([evidence, ...], one per
failed rank). Unknown keys and ill-typed values are ignored: classify never raises.

Precedence (the first rule of `RULES` that matches decides; the table is in that order):

1. Kubernetes said why, explicitly: a `DisruptionTarget` pod condition, node loss
   (NodeLost, NodeNotReady), preemption, eviction. The cluster's own record of a
   disruption outranks everything the dying container printed, except that an eviction
   whose message says the pod exceeded its *own* limit (ephemeral storage) is user, even
   with a DisruptionTarget condition: the retry would hit the same limit.
2. The container runtime said why: `OOMKilled` (the memory limit is too small for the job),
   image pulls (throttled: infra; missing or unauthorized: user),
   `CreateContainerConfigError`, `DeadlineExceeded`.
3. The trainer said why: its dedicated exit codes (75 = preempted, 2 = bad config) and its
   error record's `source` ("config": user; "user": user unless the exception is itself an
   infrastructure symptom, see 4; an explicit null: not the user's code, so rule
   `user-exception` does not blame the user for that rank).
4. A Python exception from the training process: CUDA out of memory, import and syntax
   errors, an illegal memory access (a kernel/indexing bug, unless the same evidence shows
   a hardware Xid/ECC error), or any exception raised through the trainer's or the user's
   own frames. An exception is judged by its type and message first: one that is itself an
   infrastructure symptom (EIO, ESTALE, a connection reset, an NCCL remote error, an ECC
   error) is infra wherever it was raised, so it falls through to 5.
5. Infrastructure log patterns: GPU hardware errors (Xid, ECC, unspecified launch
   failure), collective timeouts, peers that closed the connection, rendezvous failures,
   transient storage and network errors, unschedulable pods.
6. The exit code or signal alone: SIGTERM/143 (preemption path), SIGKILL/137 without
   OOMKilled (killed from outside). torchrun's own summary line
   "failed (exitcode: -9) local_rank: R" counts as the worker's signal.

Across ranks (`ranks`), each rank is judged alone, then the root cause is chosen:
a rank whose verdict is primary (any rule except the "secondary" ones below) beats all
others, in table order: a user exception on rank 1 outranks rank 0's
"Connection closed by peer", and an explicit disruption or a SIGKILL on one rank makes the
peers' connection resets infra. Secondary rules (collective timeout, peer connection lost,
rendezvous failure, SIGTERM, which torchrun sends to the surviving workers) describe how a
rank dies *because another one did*; they decide only when no rank has a primary cause, and
a rank that failed for an unknown reason outranks them (it is the likelier first failure),
so the gang is then `unknown`. Among secondary verdicts a SIGTERMed rank (a preempted pod)
is preferred: it explains its peers' lost connections. The reason names the decisive rank
and lists the others' rules: "... [also rank 0: peer-connection-lost]".
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["RULES", "Rule", "Verdict", "classify", "main"]

Kind = Literal["infra", "user", "unknown"]
KINDS = ("infra", "user", "unknown")
MAX_REASON = 299
PREEMPTED_EXIT_CODE = 75  # the trainer exits 75 (EX_TEMPFAIL) after a graceful SIGTERM stop
CONFIG_EXIT_CODE = 2  # the trainer (argparse) exits 2 on a bad command line or config


@dataclass(frozen=True)
class Verdict:
    """The classifier's answer. `rule` names the decisive rule (not part of the JSON contract)."""

    kind: Kind
    retryable: bool
    reason: str
    rule: str = field(default="", compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: must be one of {KINDS}")

    def to_dict(self) -> dict[str, Any]:
        """The contract-4 JSON object: {"kind", "retryable", "reason"}."""
        return {"kind": self.kind, "retryable": self.retryable, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        kind = data.get("kind", "unknown")
        return cls(kind=kind, retryable=bool(data.get("retryable", kind != "user")), reason=str(data.get("reason", "")))


# --------------------------------------------------------------------------------------------
# Evidence, normalised
# --------------------------------------------------------------------------------------------

_SIGNALS = {
    "SIGHUP": 1, "SIGINT": 2, "SIGQUIT": 3, "SIGILL": 4, "SIGTRAP": 5, "SIGABRT": 6, "SIGBUS": 7,
    "SIGFPE": 8, "SIGKILL": 9, "SIGUSR1": 10, "SIGSEGV": 11, "SIGUSR2": 12, "SIGPIPE": 13,
    "SIGALRM": 14, "SIGTERM": 15,
}  # fmt: skip
_SIGNAL_NAMES = {v: k for k, v in _SIGNALS.items()}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)?(\d+)\]:\s?")
_RANK_IN_LINE = re.compile(r"\[(?:rank|Rank|RANK)\s*(\d+)\]|\bRank (\d+)\b")


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return _ANSI.sub("", value)
    if isinstance(value, (list, tuple)):
        return "".join(_text(v) for v in value)
    return _ANSI.sub("", str(value))


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def _signal(value: Any) -> int | None:
    number = _int(value)
    if number is not None:
        return abs(number) or None
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        return _SIGNALS.get(name)
    return None


def _dicts(value: Any) -> list[dict]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _one_line(text: str, limit: int = 160, focus: str = "") -> str:
    """`text` on one line, at most `limit` chars, cut so that `focus` (if found) stays visible."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    at = text.find(" ".join(focus.split())) if focus else -1
    if at + len(focus) > limit - 1:
        start = max(0, min(at - limit // 3, len(text) - limit + 1))
        text = "…" + text[start + 1 :]
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


@dataclass
class _Exc:
    """One exception as printed at the end of a traceback, or as an error record's message."""

    type: str  # as printed: "ValueError", "torch.OutOfMemoryError"
    message: str
    frames: list[str] = field(default_factory=list)  # 'path:line' of each frame, innermost last
    rank: int | None = None
    chain: list[_Exc] = field(default_factory=list)  # earlier exceptions of the same chain

    @property
    def name(self) -> str:
        return self.type.rsplit(".", 1)[-1]

    @property
    def text(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type

    def all(self) -> list[_Exc]:
        return [*self.chain, self]


@dataclass
class _Record:
    """The error file: TorchElastic's format plus gangflow's trainer fields."""

    exc: _Exc | None
    rank: int | None
    step: int | None
    source: str | None  # "user" | "config" (gangflow trainer) or None
    callstack: str
    source_given: bool = False  # the trainer wrote `source` (null: "not the user's code")


@dataclass
class _Facts:
    exit_code: int | None
    signal: int | None
    termination_reason: str
    pod_phase: str
    pod_reason: str
    pod_message: str
    conditions: list[dict]
    events: list[dict]
    log_tail: str
    record: _Record | None
    tracebacks: list[_Exc]
    rank: int | None
    step: int | None
    launcher_signal: int | None = None  # from torchrun's "failed (exitcode: -9) local_rank: R"
    launcher_rank: int | None = None

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
        return [
            (_text(e.get("reason")), _text(e.get("message")))
            for e in self.events
            if not wanted or _text(e.get("reason")).lower() in wanted
        ]


def _parse_exception_line(line: str) -> tuple[str, str] | None:
    match = re.match(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$", line.strip())
    if not match or line[:1].isspace():
        return None
    exc_type = match.group(1)
    if not (exc_type[:1].isupper() or "." in exc_type):
        return None
    return exc_type, (match.group(2) or "").strip()


def _split_by_rank(text: str) -> dict[int | None, list[str]]:
    streams: dict[int | None, list[str]] = {}
    for raw in text.splitlines():
        match = _RANK_PREFIX.match(raw)
        rank = int(match.group(1)) if match else None
        streams.setdefault(rank, []).append(raw[match.end() :] if match else raw)
    return streams


def _parse_tracebacks(text: str) -> list[_Exc]:
    """Every Python traceback in `text`, chained ones folded into the last of their chain."""
    found: list[_Exc] = []
    for rank, lines in _split_by_rank(text).items():
        pending_chain: list[_Exc] = []
        i = 0
        while i < len(lines):
            if lines[i].strip() != "Traceback (most recent call last):":
                i += 1
                continue
            frames: list[str] = []
            i += 1
            exc: _Exc | None = None
            while i < len(lines):
                line = lines[i]
                frame = re.match(r'^\s+File "([^"]+)", line (\d+)', line)
                if frame:
                    frames.append(f"{frame.group(1)}:{frame.group(2)}")
                elif line.strip() and not line[:1].isspace():
                    parsed = _parse_exception_line(line)
                    if parsed:
                        message = parsed[1]
                        # Multi-line messages (NCCL errors): keep following unindented lines.
                        j = i + 1
                        while j < len(lines) and j <= i + 3 and lines[j].strip() and not lines[j][:1].isspace():
                            if lines[j].startswith(("Traceback", "During handling", "The above exception")):
                                break
                            message += " " + lines[j].strip()
                            j += 1
                        exc = _Exc(parsed[0], message, frames, rank)
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


def _parse_record(value: Any) -> _Record | None:
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = {"message": value}
    if not isinstance(value, dict):
        return None
    outer = value
    message = outer.get("message")
    inner = message if isinstance(message, dict) else {}
    text = _text(inner.get("message") if inner else message)
    extra = inner.get("extraInfo") or outer.get("extraInfo") or {}
    extra = extra if isinstance(extra, dict) else {}
    sources = (outer, inner, extra)

    def pick(key: str) -> Any:
        for source in sources:
            if key in source:
                return source[key]
        return None

    # TorchElastic keeps the stack in extraInfo.py_callstack; the trainer's own record
    # (DIR/errors/rank-R.json, the Kubernetes termination message) in `traceback`.
    callstack = _text(extra.get("py_callstack") or pick("traceback"))

    exc_type = _text(pick("exc_type")).strip()
    exc: _Exc | None = None
    first, _, rest = text.strip().partition("\n")
    parsed = _parse_exception_line(first) if first else None
    if exc_type:
        msg = text.strip()
        if msg.startswith(exc_type + ":"):
            msg = msg[len(exc_type) + 1 :].strip()
        exc = _Exc(exc_type, _one_line(msg, 400))
    elif parsed:
        exc = _Exc(parsed[0], _one_line(parsed[1] + " " + rest, 400))
    elif text.strip():
        exc = _Exc("Error", _one_line(text, 400))
    if exc is not None and callstack:
        exc.frames = [f"{m.group(1)}:{m.group(2)}" for m in re.finditer(r'File "([^"]+)", line (\d+)', callstack)]
    source = _text(pick("source")).strip().lower() or None
    given = any("source" in d for d in sources)
    return _Record(exc, _int(pick("rank")), _int(pick("step")), source, callstack, given)


def _facts(ev: Mapping[str, Any]) -> _Facts:
    record = _parse_record(ev.get("error_file"))
    log_tail = _text(ev.get("log_tail"))
    tracebacks = _parse_tracebacks(log_tail)
    if record is not None and record.callstack and "Traceback" in record.callstack:
        tracebacks += _parse_tracebacks(record.callstack)
    exit_code = _int(ev.get("exit_code"))
    signal = _signal(ev.get("signal"))
    if signal is None and exit_code is not None:
        if exit_code < 0:
            signal = -exit_code
        elif 128 < exit_code <= 128 + 64:
            signal = exit_code - 128
    launcher_signal = launcher_rank = None
    launcher = _LAUNCHER_EXIT.search(log_tail)
    if launcher and int(launcher.group(1)) < 0:
        launcher_signal, launcher_rank = -int(launcher.group(1)), int(launcher.group(2))
    rank = _int(ev.get("rank"))
    if rank is None and record is not None:
        rank = record.rank
    step = _int(ev.get("step"))
    if step is None and record is not None:
        step = record.step
    return _Facts(
        exit_code=exit_code,
        signal=signal,
        termination_reason=_text(ev.get("termination_reason")).strip(),
        pod_phase=_text(ev.get("pod_phase")).strip(),
        pod_reason=_text(ev.get("pod_reason")).strip(),
        pod_message=_text(ev.get("pod_message")).strip(),
        conditions=_dicts(ev.get("pod_conditions")),
        events=_dicts(ev.get("events")),
        log_tail=log_tail,
        record=record,
        tracebacks=tracebacks,
        rank=rank,
        step=step,
        launcher_signal=launcher_signal,
        launcher_rank=launcher_rank,
    )


# --------------------------------------------------------------------------------------------
# Patterns
# --------------------------------------------------------------------------------------------


def _rx(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


# Hardware Xids (NVIDIA's Xid catalogue): 13/31/43/45 are usually the application's own fault
# (illegal address, MMU fault, stopped/cleaned-up channel) and are not decisive on their own.
_XID = re.compile(r"NVRM: Xid \([^)]*\):\s*(\d+)", re.IGNORECASE)
_APP_XIDS = {13, 31, 43, 45}
_GPU_HARDWARE = _rx(
    r"uncorrectable ECC error",
    r"ECC_UNCORRECTABLE",
    r"\bdouble[- ]bit ECC",
    r"fallen off the bus",
    r"CUDA error: unspecified launch failure",
    r"CUDA error: (?:an )?uncorrectable NVLink error",
    r"GPU (?:is lost|has fallen)",
)
_COLLECTIVE_TIMEOUT = _rx(
    r"Watchdog caught collective operation timeout",
    r"NCCL watchdog[^\n]*time(?:d )?out",
    r"ProcessGroupNCCL[^\n]*time(?:d )?out",
    r"ProcessGroupGloo[^\n]*Timed out",
    r"gloo[^\n]*Timed out waiting",
    r"Some NCCL operations have failed or timed out",
    r"NCCL communicator was aborted",
)
_PEER_LOST = _rx(
    r"Connection closed by (?:remote )?peer",
    r"Connection reset by peer",
    r"ncclRemoteError",
    r"remote process exited or there was a network error",
    r"Got completion from peer [^\n]* with (?:error|status)",
    r"NET/IB[^\n]*error",
    r"Broken pipe",
)
_RENDEZVOUS = _rx(
    r"RendezvousTimeoutError",
    r"RendezvousClosedError",
    r"RendezvousConnectionError",
    r"The client socket has timed out after \d+",
    r"connect\(\) timed out\. Original timeout",
)
_STORAGE = _rx(
    r"Stale (?:NFS )?file handle",
    r"\[Errno 116\]",
    r"Input/output error",
    r"\[Errno 5\]",
    r"\bEIO\b",
    r"\bSlowDown\b",
    r"Please reduce your request rate",
    r"503 Service Unavailable",
    r"HTTP Error 503",
    r"Status Code: 503",
    r"ServiceUnavailable",
    r"\bRequestTimeout\b",
)
_NETWORK = _rx(
    r"Temporary failure in name resolution",
    r"Name or service not known",
    r"\bgaierror\b",
    r"\bConnectionError\b",
    r"ConnectionRefusedError",
    r"ConnectionResetError",
    r"ConnectionAbortedError",
    r"NewConnectionError",
    r"Max retries exceeded with url",
    r"RemoteDisconnected",
    r"Connection timed out",
    r"\bETIMEDOUT\b",
    r"Network is unreachable",
    r"No route to host",
    r"(?:502 Bad Gateway|504 Gateway Time-?out)",
    r"\b(?:TimeoutError|BrokenPipeError|DistNetworkError|EndpointConnectionError|ReadTimeout|ConnectTimeout)\b",
    r"Could not connect to the endpoint URL",
    r"Read timed out",
)
# A message matching any of these is an infrastructure symptom wherever it was raised.
_INFRA_MESSAGE = (_GPU_HARDWARE, _COLLECTIVE_TIMEOUT, _PEER_LOST, _RENDEZVOUS, _STORAGE, _NETWORK)
_INFRA_EXC_NAMES = {
    "ConnectionError", "ConnectionResetError", "ConnectionRefusedError", "ConnectionAbortedError",
    "BrokenPipeError", "TimeoutError", "gaierror", "DistNetworkError", "RendezvousTimeoutError",
    "RendezvousClosedError", "RendezvousConnectionError", "NewConnectionError", "MaxRetryError",
    "EndpointConnectionError", "ReadTimeout", "ConnectTimeout", "ReadTimeoutError",
}  # fmt: skip
# Launcher wrappers: their traceback is torchrun's, not the cause.
_WRAPPERS = {"ChildFailedError", "SignalException", "SystemExit", "KeyboardInterrupt", "CalledProcessError"}
_CUDA_OOM = _rx(r"CUDA out of memory", r"\bOutOfMemoryError\b", r"CUDA error: out of memory")
_IMPORT_ERROR = re.compile(r"^(?:\[\w*\d+\]:\s*)?(ModuleNotFoundError|ImportError|SyntaxError|IndentationError|TabError)\b:?(.*)$", re.MULTILINE)  # fmt: skip
_ILLEGAL_ACCESS = _rx(
    r"CUDA error: an illegal memory access was encountered",
    r"CUDA error: device-side assert triggered",
    r"CUDA error: misaligned address",
    r"CUDA error: an illegal instruction was encountered",
)
_IMAGE_THROTTLED = _rx(r"toomanyrequests", r"429 Too Many Requests", r"pull rate limit", r"rate[- ]limit")
_IMAGE_MISSING = _rx(
    r"manifest unknown",
    r"not found",
    r"unauthorized",
    r"pull access denied",
    r"repository does not exist",
    r"authentication required",
    r"denied: requested access",
    r"InvalidImageName",
)
_CONTAINER_LIMIT = _rx(
    r"exceeds the total limit of containers",
    r"exceeded its local ephemeral storage limit",
    r"exceeds its limit",
    r"emptyDir usage exceeds",
)
_NODE_LOST = _rx(
    r"\bNodeLost\b",
    r"\bnode\b[^\n]{0,80}\bnot ready\b",
    r"NodeNotReady",
    r"node[^\n]{0,40}unreachable",
    r"Node \S+ which was running pod \S+ is unresponsive",
)
# torchrun's own summary of the first failed worker: the worker's exit code or signal.
_LAUNCHER_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _first(pattern: re.Pattern[str], texts: Iterable[str]) -> tuple[str, str] | None:
    """(matched line, matched text) of the first match of `pattern` in `texts`.

    An unindented line (an exception or log line) is preferred over an indented one (the
    source line `raise X()` that a traceback prints just before the exception itself).
    """
    first: tuple[str, str] | None = None
    for text in texts:
        for match in pattern.finditer(text):
            start = text.rfind("\n", 0, match.start()) + 1
            end = text.find("\n", match.end())
            raw = text[start : end if end >= 0 else len(text)]
            found = (raw.strip(), match.group(0))
            body = raw[_RANK_PREFIX.match(raw).end() :] if _RANK_PREFIX.match(raw) else raw
            if not body[:1].isspace():
                return found
            first = first or found
    return first


def _line_rank(line: str) -> int | None:
    match = _RANK_IN_LINE.search(line) or _RANK_PREFIX.match(line)
    if not match:
        return None
    return int(next(g for g in match.groups() if g is not None))


def _is_infra_exc(exc: _Exc) -> bool:
    for one in exc.all():
        if one.name in _INFRA_EXC_NAMES:
            return True
        if any(p.search(one.text) for p in _INFRA_MESSAGE):
            return True
        if one.name in {"OSError", "IOError"} and re.search(r"\[Errno (?:5|110|104|116|11)\]", one.message):
            return True
    return False


# Frameworks whose frames are library code even when run from a source checkout.
_FRAMEWORK_DIRS = re.compile(r"/(?:torch|torchvision|torchaudio|transformers|accelerate|deepspeed|lightning|pytorch_lightning|numpy)/")  # fmt: skip


def _is_library_path(path: str) -> bool:
    norm = path.replace("\\", "/")
    if norm.startswith("<"):
        return True
    markers = ("/site-packages/", "/dist-packages/", "/lib/python", "/lib64/python", "/runpy.py")
    if any(m in norm for m in markers) or _FRAMEWORK_DIRS.search(norm):
        return True
    return norm.rsplit("/", 2)[-2:-1] == ["bin"]


def _user_frame(exc: _Exc) -> str | None:
    """The innermost frame of the exception (or its chain) that is not library code."""
    for one in reversed(exc.all()):
        for frame in reversed(one.frames):
            if not _is_library_path(frame.rsplit(":", 1)[0]):
                return frame
    return None


def _short_path(frame: str) -> str:
    path, _, line = frame.rpartition(":")
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) + (f":{line}" if line else "")


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """What a rule saw: `what` names the signal, `excerpt` quotes the evidence."""

    what: str
    excerpt: str = ""
    rank: int | None = None
    step: int | None = None
    focus: str = ""  # the decisive words inside `excerpt`, kept visible when it is cut


Matcher = Callable[[_Facts], "Hit | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    kind: Kind
    tier: int  # 1 Kubernetes, 2 container runtime, 3 trainer, 4 exception, 5 infra log, 6 exit code
    matcher: Matcher
    secondary: bool = False  # how a rank dies because another one did (see module docstring)
    summary: str = ""

    @property
    def retryable(self) -> bool:
        return self.kind != "user"


def _disruption_condition(f: _Facts) -> Hit | None:
    for cond in f.conditions:
        if _text(cond.get("type")) == "DisruptionTarget" and _text(cond.get("status") or "True") != "False":
            reason = _text(cond.get("reason")) or "unspecified"
            return Hit(f"pod condition DisruptionTarget ({reason})", _text(cond.get("message")))
    return None


def _node_lost(f: _Facts) -> Hit | None:
    if f.pod_reason == "NodeLost" or (f.pod_phase == "Unknown" and _NODE_LOST.search(f.pod_message)):
        return Hit(f"pod reason {f.pod_reason or 'NodeLost'}", f.pod_message)
    for reason, message in f.event_texts():
        if reason in {"NodeNotReady", "NodeLost", "NodeShutdown"}:
            return Hit(f"event {reason}", message)
    if _NODE_LOST.search(f.pod_message):
        return Hit("pod message: node not ready", f.pod_message)
    return None


def _preempted(f: _Facts) -> Hit | None:
    if f.pod_reason in {"Preempting", "Preempted"}:
        return Hit(f"pod reason {f.pod_reason}", f.pod_message)
    for reason, message in f.event_texts():
        if reason == "Preempted" or reason == "Preempting" or "Preempted to accommodate" in message:
            return Hit(f"event {reason}", message)
    if f.termination_reason in {"Preempted", "Preempting"}:
        return Hit(f"termination reason {f.termination_reason}")
    return None


def _container_limit_eviction(f: _Facts) -> Hit | None:
    texts = [f.pod_message] if f.pod_reason == "Evicted" else []
    texts += [m for _, m in f.event_texts("Evicted")]
    texts += [_text(c.get("message")) for c in f.conditions if _text(c.get("type")) == "DisruptionTarget"]
    for text in texts:
        if _CONTAINER_LIMIT.search(text):
            return Hit("evicted for exceeding the pod's own limit", text)
    return None


def _evicted(f: _Facts) -> Hit | None:
    if f.pod_reason == "Evicted" or f.termination_reason == "Evicted":
        return Hit("pod reason Evicted", f.pod_message)
    for reason, message in f.event_texts("Evicted"):
        return Hit(f"event {reason}", message)
    return None


def _oom_killed(f: _Facts) -> Hit | None:
    if f.termination_reason == "OOMKilled" or f.pod_reason == "OOMKilled":
        code = f" (exit code {f.exit_code})" if f.exit_code is not None else ""
        return Hit(f"container OOMKilled{code}: its memory limit is too small for the job", f.pod_message)
    return None


def _image_events(f: _Facts) -> list[tuple[str, str]]:
    pull = {"errimagepull", "imagepullbackoff", "backoff", "failed", "failed to pull image", "invalidimagename"}
    found = [(r, m) for r, m in f.event_texts() if r.lower() in pull and re.search(r"pull|image|manifest", m, re.I)]
    pulling = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
    if f.pod_reason in pulling or f.termination_reason in pulling:  # a waiting container's reason
        found.append((f.termination_reason if f.termination_reason in pulling else f.pod_reason, f.pod_message))
    return found


def _image_throttled(f: _Facts) -> Hit | None:
    for reason, message in _image_events(f):
        match = _IMAGE_THROTTLED.search(message)
        if match:
            return Hit(f"image pull throttled (event {reason})", message, focus=match.group(0))
    return None


def _image_missing(f: _Facts) -> Hit | None:
    for reason, message in _image_events(f):
        matches = list(_IMAGE_MISSING.finditer(message))  # the registry's verdict ends the message
        if matches or reason == "InvalidImageName":
            focus = message[matches[0].start() : matches[-1].end()] if matches else ""
            return Hit(f"image cannot be pulled (event {reason})", message, focus=focus)
    return None


def _create_container_config_error(f: _Facts) -> Hit | None:
    if "CreateContainerConfigError" in (f.pod_reason, f.termination_reason):
        return Hit("CreateContainerConfigError (a missing Secret/ConfigMap or key)", f.pod_message)
    for reason, message in f.event_texts():
        if reason == "CreateContainerConfigError" or re.search(
            r"(?:secrets?|configmaps?) \"[^\"]+\" not found|couldn't find key \S+ in (?:Secret|ConfigMap)", message
        ):
            return Hit("CreateContainerConfigError (a missing Secret/ConfigMap or key)", message)
    return None


def _deadline_exceeded(f: _Facts) -> Hit | None:
    if f.pod_reason == "DeadlineExceeded" or f.termination_reason == "DeadlineExceeded":
        return Hit("pod reason DeadlineExceeded: the job's activeDeadlineSeconds is too short", f.pod_message)
    return None


def _trainer_preempted(f: _Facts) -> Hit | None:
    if f.exit_code == PREEMPTED_EXIT_CODE:
        return Hit(f"trainer exit code {PREEMPTED_EXIT_CODE} (stopped on SIGTERM, the preemption path)")
    return None


def _trainer_config_error(f: _Facts) -> Hit | None:
    rec = f.record
    if rec is not None and rec.source == "config":
        exc = rec.exc
        return Hit(f"bad config ({exc.name if exc else 'trainer error record'})", exc.message if exc else "")
    if f.exit_code == CONFIG_EXIT_CODE:
        usage = _first(re.compile(r"^.*error: .*$", re.MULTILINE), [f.log_tail])
        return Hit(f"trainer exit code {CONFIG_EXIT_CODE} (bad command line or config)", usage[0] if usage else "")
    return None


def _trainer_user_record(f: _Facts) -> Hit | None:
    rec = f.record
    if rec is None or rec.source != "user" or rec.exc is None or _is_infra_exc(rec.exc):
        return None
    return Hit(f"{rec.exc.name} raised in training code", rec.exc.message, rec.rank, rec.step)


def _candidate_exceptions(f: _Facts) -> list[_Exc]:
    excs = [e for e in f.tracebacks if e.name not in _WRAPPERS]
    rec = f.record
    if rec is not None and rec.exc is not None and rec.source is None and rec.exc.name not in _WRAPPERS:
        excs.insert(0, rec.exc)
    return excs


def _cuda_oom(f: _Facts) -> Hit | None:
    for exc in _candidate_exceptions(f):
        if _CUDA_OOM.search(exc.text):
            return Hit("CUDA out of memory (batch or model too large for the GPU)", exc.text, exc.rank)
    hit = _first(_CUDA_OOM, f.log_texts)
    if hit:
        return Hit("CUDA out of memory (batch or model too large for the GPU)", hit[0], _line_rank(hit[0]))
    return None


def _import_error(f: _Facts) -> Hit | None:
    for exc in _candidate_exceptions(f):
        if exc.name in {"ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError", "TabError"}:
            return Hit(f"{exc.name} (the code or its environment is broken)", exc.message, exc.rank)
    for text in f.log_texts:
        match = _IMPORT_ERROR.search(text)
        if match:
            return Hit(f"{match.group(1)} (the code or its environment is broken)", match.group(0).strip())
    return None


def _gpu_hardware(f: _Facts) -> Hit | None:
    for text in f.log_texts:
        for match in _XID.finditer(text):
            if int(match.group(1)) not in _APP_XIDS:
                line = text[text.rfind("\n", 0, match.start()) + 1 :].split("\n", 1)[0]
                return Hit(f"GPU hardware error (Xid {match.group(1)})", line.strip())
    hit = _first(_GPU_HARDWARE, f.log_texts)
    if hit:
        return Hit(f"GPU hardware error ({hit[1]})", hit[0], _line_rank(hit[0]), focus=hit[1])
    return None


def _illegal_memory_access(f: _Facts) -> Hit | None:
    hit = _first(_ILLEGAL_ACCESS, f.log_texts)
    if hit is None or _gpu_hardware(f) is not None:
        return None
    return Hit(f"{hit[1]} (a kernel or indexing bug; rerun with CUDA_LAUNCH_BLOCKING=1)", hit[0], _line_rank(hit[0]))


def _user_exception(f: _Facts) -> Hit | None:
    if f.record is not None and f.record.source_given and f.record.source is None:
        return None  # the trainer's record says this exception did not come from user code
    for exc in _candidate_exceptions(f):
        if _is_infra_exc(exc):
            continue
        frame = _user_frame(exc)
        if frame is None:
            continue
        rec = f.record
        step = rec.step if rec is not None and rec.exc is exc else None
        return Hit(f"{exc.name} raised in training code", f"{exc.message} ({_short_path(frame)})", exc.rank, step)
    return None


def _log_rule(pattern: re.Pattern[str], what: str) -> Matcher:
    def matcher(f: _Facts) -> Hit | None:
        hit = _first(pattern, f.log_texts)
        return Hit(what, hit[0], _line_rank(hit[0]), focus=hit[1]) if hit else None

    return matcher


def _failed_scheduling(f: _Facts) -> Hit | None:
    for reason, message in f.event_texts("FailedScheduling"):
        return Hit("event FailedScheduling (no room for the gang right now)", message)
    return None


def _signal_hit(f: _Facts, number: int, what: str) -> Hit | None:
    if f.signal == number:
        how = f"exit code {f.exit_code}" if f.exit_code is not None else "signal"
        return Hit(f"{_SIGNAL_NAMES[number]} ({how}){what}")
    if f.signal is None and f.launcher_signal == number:
        line = _first(_LAUNCHER_EXIT, [f.log_tail])
        how = f"torchrun: local_rank {f.launcher_rank} exit code -{number}"
        return Hit(f"{_SIGNAL_NAMES[number]} ({how}){what}", line[0] if line else "")
    return None


def _sigterm(f: _Facts) -> Hit | None:
    return _signal_hit(f, 15, ": the preemption/eviction path")


def _sigkill(f: _Facts) -> Hit | None:
    return _signal_hit(f, 9, " without OOMKilled: killed from outside")


RULES: tuple[Rule, ...] = (
    # 1. Kubernetes said why.
    Rule("evicted-over-own-limit", "user", 1, _container_limit_eviction, summary="Evicted: pod exceeded its own limit"),
    Rule("k8s-disruption", "infra", 1, _disruption_condition, summary="DisruptionTarget pod condition"),
    Rule("node-lost", "infra", 1, _node_lost, summary="NodeLost / NodeNotReady / node not ready"),
    Rule("k8s-preempted", "infra", 1, _preempted, summary="pod reason Preempting, event Preempted"),
    Rule("k8s-evicted", "infra", 1, _evicted, summary="pod reason / event Evicted (node pressure)"),
    # 2. The container runtime said why.
    Rule("oom-killed", "user", 2, _oom_killed, summary="termination reason OOMKilled"),
    Rule("image-pull-throttled", "infra", 2, _image_throttled, summary="pull failed: toomanyrequests / 429"),
    Rule("image-missing", "user", 2, _image_missing, summary="pull failed: manifest unknown / not found / unauthorized"),
    Rule("container-config-error", "user", 2, _create_container_config_error, summary="CreateContainerConfigError"),
    Rule("deadline-exceeded", "user", 2, _deadline_exceeded, summary="pod reason DeadlineExceeded"),
    # 3. The trainer said why.
    Rule("trainer-preempted-exit", "infra", 3, _trainer_preempted, summary="trainer exit code 75"),
    Rule("trainer-config-error", "user", 3, _trainer_config_error, summary="error record source config / exit code 2"),
    Rule("trainer-user-error", "user", 3, _trainer_user_record, summary="error record source user"),
    # 4. An exception from the training process.
    Rule("cuda-oom", "user", 4, _cuda_oom, summary="CUDA out of memory"),
    Rule("import-error", "user", 4, _import_error, summary="ModuleNotFoundError / ImportError / SyntaxError"),
    Rule("illegal-memory-access", "user", 4, _illegal_memory_access, summary="CUDA illegal memory access, no Xid/ECC"),
    Rule("user-exception", "user", 4, _user_exception, summary="traceback through the trainer's/user's frames"),
    # 5. Infrastructure log patterns.
    Rule("gpu-hardware", "infra", 5, _gpu_hardware, summary="NVRM Xid (hardware), ECC, unspecified launch failure"),
    Rule(
        "collective-timeout", "infra", 5, _log_rule(_COLLECTIVE_TIMEOUT, "collective timeout (a peer stopped answering)"),
        secondary=True, summary="NCCL/gloo watchdog timeout",
    ),  # fmt: skip
    Rule(
        "peer-connection-lost", "infra", 5, _log_rule(_PEER_LOST, "connection to a peer lost"),
        secondary=True, summary="Connection closed/reset by peer, ncclRemoteError",
    ),  # fmt: skip
    Rule(
        "rendezvous-failure", "infra", 5, _log_rule(_RENDEZVOUS, "rendezvous failed"),
        secondary=True, summary="RendezvousTimeoutError / RendezvousClosedError",
    ),  # fmt: skip
    Rule("transient-storage", "infra", 5, _log_rule(_STORAGE, "transient storage error"), summary="EIO, ESTALE, S3 SlowDown, 503"),  # fmt: skip
    Rule("transient-network", "infra", 5, _log_rule(_NETWORK, "transient network error"), summary="DNS, ConnectionError"),  # fmt: skip
    Rule("failed-scheduling", "infra", 5, _failed_scheduling, summary="event FailedScheduling"),
    # 6. The exit code or signal alone.
    Rule("sigterm", "infra", 6, _sigterm, secondary=True, summary="SIGTERM / exit code 143"),
    Rule("killed-from-outside", "infra", 6, _sigkill, summary="SIGKILL / exit code 137 without OOMKilled"),
)
_RULE_INDEX = {rule.name: i for i, rule in enumerate(RULES)}


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Judged:
    rule: Rule | None
    hit: Hit | None
    facts: _Facts
    label: str  # "rank 1", "gang", "rank entry 2"

    @property
    def order(self) -> int:
        return _RULE_INDEX[self.rule.name] if self.rule else len(RULES)


def _judge(ev: Mapping[str, Any], label: str) -> _Judged:
    facts = _facts(ev)
    for rule in RULES:
        try:
            hit = rule.matcher(facts)
        except Exception:  # a malformed piece of evidence must not hide the others
            hit = None
        if hit is not None:
            return _Judged(rule, hit, facts, label)
    return _Judged(None, None, facts, label)


def _where(rank: int | None, step: int | None) -> str:
    parts = ([f"rank {rank}"] if rank is not None else []) + ([f"step {step}"] if step is not None else [])
    return f" at {', '.join(parts)}" if parts else ""


def _fallback_summary(f: _Facts) -> str:
    bits = []
    if f.exit_code is not None:
        bits.append(f"exit code {f.exit_code}")
    if f.signal is not None and f.signal in _SIGNAL_NAMES:
        bits.append(_SIGNAL_NAMES[f.signal])
    if f.termination_reason:
        bits.append(f"termination reason {f.termination_reason}")
    if f.pod_reason:
        bits.append(f"pod reason {f.pod_reason}")
    last = next((ln.strip() for ln in reversed(f.log_tail.splitlines()) if ln.strip()), "")
    if last:
        bits.append(f"last log line: {last}")
    return "; ".join(bits) or "no evidence"


def _verdict(judged: _Judged, note: str = "") -> Verdict:
    f = judged.facts
    if judged.rule is None or judged.hit is None:
        where = _where(f.rank, f.step)
        reason = f"unknown: no rule matched{where} ({_fallback_summary(f)})"
        return Verdict("unknown", True, _clip(reason + note), rule="")
    hit = judged.hit
    rank = hit.rank if hit.rank is not None else f.rank
    step = hit.step if hit.step is not None else f.step
    reason = f"{judged.rule.kind}: {hit.what}{_where(rank, step)}"
    excerpt = _one_line(hit.excerpt, 160, hit.focus)
    if excerpt:
        reason += f": {excerpt}"
    return Verdict(judged.rule.kind, judged.rule.retryable, _clip(reason + note), rule=judged.rule.name)


def _clip(reason: str) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 1].rstrip() + "…"


def _pick_root(judged: list[_Judged]) -> tuple[_Judged, str]:
    primary = [j for j in judged if j.rule is not None and not j.rule.secondary]
    # Gang-level evidence that matched nothing (torchrun's "exit code 1") is not a rank that
    # failed on its own: it does not outrank the ranks' secondary symptoms.
    unknown_ranks = [j for j in judged if j.rule is None and j.label != "gang"]
    secondary = [j for j in judged if j.rule is not None and j.rule.secondary]
    if primary:
        root = min(primary, key=lambda j: j.order)
    elif unknown_ranks:
        # A rank that died for no visible reason is likelier the first failure than the peers
        # that lost their connection to it.
        root = unknown_ranks[0]
    elif secondary:
        # A SIGTERMed rank (preempted pod) explains its peers' lost connections, not the reverse.
        root = min(secondary, key=lambda j: (j.rule.name != "sigterm", j.order))
    else:
        root = judged[0]
    others = [j for j in judged if j is not root and j.rule is not None and j.rule is not root.rule]
    note = ""
    if others:
        seen = []
        for j in others:
            tag = f"{j.label}: {j.rule.name}"
            if tag not in seen:
                seen.append(tag)
        note = f" [also {', '.join(seen[:3])}{', …' if len(seen) > 3 else ''}]"
    return root, note


def classify(evidence: Mapping[str, Any]) -> Verdict:
    """Judge a failed gang's evidence (DESIGN.md contract 4). Never raises on odd evidence."""
    if not isinstance(evidence, Mapping):
        return Verdict("unknown", True, f"unknown: evidence is a {type(evidence).__name__}, not an object")
    ranks = evidence.get("ranks")
    top = {k: v for k, v in evidence.items() if k != "ranks"}
    if not isinstance(ranks, list) or not any(isinstance(r, Mapping) for r in ranks):
        return _verdict(_judge(top, "gang"))
    judged: list[_Judged] = []
    if any(v not in (None, "", [], {}) for k, v in top.items() if k not in {"rank", "step"}):
        judged.append(_judge(top, "gang"))
    for i, entry in enumerate(ranks):
        if isinstance(entry, Mapping):
            j = _judge(entry, f"rank entry {i}")
            if j.facts.rank is not None:
                j = _Judged(j.rule, j.hit, j.facts, f"rank {j.facts.rank}")
            elif j.hit is not None and j.hit.rank is not None:
                j = _Judged(j.rule, j.hit, j.facts, f"rank {j.hit.rank}")
            judged.append(j)
    root, note = _pick_root(judged)
    return _verdict(root, note)


def main(argv: list[str] | None = None) -> int:
    """`python -m operators.failures [FILE] < evidence.json`: print the verdict as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in {"-h", "--help"}:
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m operators.failures [EVIDENCE.json] < evidence.json")
        return 0
    try:
        if args:
            with open(args[0], encoding="utf-8") as fh:
                raw = fh.read()
            origin = args[0]
        else:
            raw, origin = sys.stdin.read(), "stdin"
    except OSError as exc:
        print(f"operators.failures: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        evidence = json.loads(raw)
    except ValueError as exc:
        print(f"operators.failures: evidence on {origin} is not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(evidence, dict):
        print(f"operators.failures: evidence on {origin} must be a JSON object, got {type(evidence).__name__}", file=sys.stderr)  # fmt: skip
        return 2
    print(json.dumps(classify(evidence).to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
