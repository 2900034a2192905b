"""`python -m operators.failures [FILE] < evidence.json`: print the verdict as JSON (contract 4).

Bad input gets one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys

from operators.failures.evidence import _bounded_int
from operators.failures.ranks import classify

USAGE = (
    "Classify a failed training gang's evidence: infra (retry), user (fail now) or unknown.\n\n"
    "usage: python -m operators.failures [EVIDENCE.json] < evidence.json\n\n"
    'prints {"kind": "infra"|"user"|"unknown", "retryable": bool, "reason": "..."}; see docs/failures.md'
)
MAX_INPUT = 16 * 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in {"-h", "--help"}:
        print(USAGE)
        return 0
    try:
        if args:
            with open(args[0], encoding="utf-8", errors="replace") as fh:
                raw = fh.read(MAX_INPUT + 1)
            origin = args[0]
        else:
            stream = getattr(sys.stdin, "buffer", None)  # bytes: undecodable input is not a traceback
            data = stream.read(MAX_INPUT + 1) if stream is not None else sys.stdin.read(MAX_INPUT + 1)
            raw = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
            origin = "stdin"
    except OSError as exc:
        print(f"operators.failures: cannot read {exc.filename or args[0]}: {exc.strerror}", file=sys.stderr)
        return 2
    if len(raw) > MAX_INPUT:
        print(f"operators.failures: evidence on {origin} is larger than {MAX_INPUT} bytes", file=sys.stderr)
        return 2
    try:
        evidence = json.loads(raw, parse_int=_bounded_int)
    except RecursionError:
        print(f"operators.failures: evidence on {origin} is nested too deeply to read", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"operators.failures: evidence on {origin} is not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(evidence, dict):
        print(f"operators.failures: evidence on {origin} must be a JSON object, got {type(evidence).__name__}", file=sys.stderr)  # fmt: skip
        return 2
    try:
        print(json.dumps(classify(evidence).to_dict()))
    except Exception as exc:  # noqa: BLE001 - contract: the CLI never prints a traceback
        print(f"operators.failures: could not classify the evidence on {origin}: {type(exc).__name__}: {exc}", file=sys.stderr)  # fmt: skip
        return 1
    return 0
