"""No input stalls the worker (issue 28, item 3): every classifier pattern is linear, evidence is
bounded per rank before any pattern sees it, and a 64 KiB line without spaces is cheap.

`\\w+ are evicted\\b` took 16.7 s over one 64 KiB line without spaces: an unbounded repeat that
opens an unanchored pattern is retried from every position of the line (quadratic).
"""

from __future__ import annotations

import base64
import importlib
import random
import re
import time

import pytest

try:  # Python 3.11+ renamed the module; the parse tree is the same
    from re import _constants as sre_constants
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from operators.failures import classify
from operators.failures.evidence import LINE_HEAD, LINE_TAIL, MAX_LINE, RANK_LOG_MIN, Evidence

MODULES = ("operators.failures.rules", "operators.failures.evidence", "trainer.failure_catalogue", "operators.failures.precedent")
UNBOUNDED = sre_constants.MAXREPEAT
REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


def patterns() -> list[tuple[str, re.Pattern[str]]]:
    found = []
    for name in MODULES:
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, re.Pattern):
                found.append((f"{name}.{attr}", value))
    return found


PATTERNS = patterns()


def _items(tree):
    return list(tree.data if hasattr(tree, "data") else tree)


def _shapes(tree, *, in_repeat: bool, at_start: bool) -> list[str]:
    """Catastrophic shapes in a parsed pattern: an unbounded repeat inside an unbounded repeat,
    or an unbounded repeat that opens an unanchored branch (tried from every position: quadratic)."""
    bad: list[str] = []
    for index, (op, av) in enumerate(_items(tree)):
        # A repeat after an anchor (^, \A, \b) is tried only where the anchor holds: not "first".
        first = at_start and index == 0
        if op in REPEATS:
            low, high, sub = av
            if high == UNBOUNDED and in_repeat:
                bad.append("an unbounded repeat nested in a repeat")
            if high == UNBOUNDED and first:
                bad.append("an unbounded repeat opening a branch")
            bad += _shapes(sub, in_repeat=in_repeat or high == UNBOUNDED, at_start=first)
        elif op == sre_constants.BRANCH:
            for branch in av[1]:
                bad += _shapes(branch, in_repeat=in_repeat, at_start=first)
        elif op == sre_constants.SUBPATTERN:
            bad += _shapes(av[-1], in_repeat=in_repeat, at_start=first)
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            bad += _shapes(av[1], in_repeat=in_repeat, at_start=False)
    return bad


def shapes(pattern: re.Pattern[str]) -> list[str]:
    return _shapes(sre_parse.parse(pattern.pattern, pattern.flags), in_repeat=False, at_start=True)


def test_the_shape_check_catches_the_quadratic_patterns_of_before():
    assert shapes(re.compile(r"The node was low|\w+ are evicted\b")) == ["an unbounded repeat opening a branch"]
    assert shapes(re.compile(r"\d+%\|")) == ["an unbounded repeat opening a branch"]
    assert "an unbounded repeat nested in a repeat" in shapes(re.compile(r"x(?:a+)+b"))
    assert shapes(re.compile(r"\b\w{1,64} are evicted\b|File \"([^\"]+)\"")) == []


@pytest.mark.parametrize("name, pattern", PATTERNS, ids=[n for n, _ in PATTERNS])
def test_no_pattern_has_a_catastrophic_shape(name, pattern):
    assert shapes(pattern) == [], f"{name}: {shapes(pattern)}"


def no_space_lines() -> dict[str, str]:
    rng = random.Random(28)
    return {
        "word": "a" * 65536,
        "digits": "0" * 65536,
        "underscores": "_" * 65536,
        "base64": base64.b64encode(rng.randbytes(49152)).decode(),
        "hex": rng.randbytes(32768).hex(),
    }


LINES = no_space_lines()


@pytest.mark.parametrize("name, pattern", PATTERNS, ids=[n for n, _ in PATTERNS])
def test_each_pattern_scans_a_64k_line_without_spaces_quickly(name, pattern):
    # Linear patterns take milliseconds here; the quadratic ones of before took 14-34 s.
    for kind, line in LINES.items():
        start = time.perf_counter()
        pattern.search(line)
        assert time.perf_counter() - start < 1.0, f"{name} on a 64 KiB {kind} line"


@pytest.mark.parametrize("kind", sorted(LINES))
def test_one_rank_with_a_64k_line_is_classified_quickly(kind):
    evidence = {"exit_code": 1, "events": [{"reason": "Evicted", "message": LINES[kind]}], "pod_message": LINES[kind],
                "log_tail": "NCCL watchdog timeout\n" + LINES[kind]}  # fmt: skip
    start = time.perf_counter()
    verdict = classify(evidence, precedents=False)
    assert time.perf_counter() - start < 1.0
    assert verdict.kind in {"infra", "user", "unknown"}


def test_a_long_line_keeps_its_head_and_tail():
    line = "RuntimeError: CUDA error: an illegal memory access " + "x" * 60_000 + " No space left on device"
    facts = Evidence.parse({"log_tail": "step 1\n" + line})
    kept = facts.log_tail.splitlines()[-1]
    assert len(kept) <= LINE_HEAD + LINE_TAIL + 3 < MAX_LINE
    assert kept.startswith("RuntimeError: CUDA error") and kept.endswith("No space left on device")


def test_ranks_share_one_log_budget_and_keep_their_tails():
    tail = "ValueError: bad label 7"
    many = Evidence.parse({"ranks": [{"rank": r, "log_tail": "step 1 loss 0.5\n" * 4000 + tail} for r in range(256)]})
    assert all(len(r.log_tail) <= RANK_LOG_MIN and r.log_tail.endswith(tail) for r in many.ranks)
    few = Evidence.parse({"ranks": [{"rank": r, "log_tail": "step 1 loss 0.5\n" * 5000} for r in range(2)]})
    assert all(len(r.log_tail) == 64 * 1024 for r in few.ranks)  # a small gang keeps a whole log tail each
