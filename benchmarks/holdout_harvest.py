"""Harvest a hold-out of the failure corpus blind, and freeze it before anyone scores it.

    python benchmarks/holdout_harvest.py start holdout27 --workspace /tmp/holdout27
    python benchmarks/holdout_harvest.py prepare holdout27 --workspace /tmp/holdout27 --seed 20261230
    python benchmarks/holdout_harvest.py freeze holdout27 --workspace /tmp/holdout27

`start` writes the workspace: excluded.txt (every project of the corpus files and split.json),
an empty claimed.txt, the harvesters' brief (brief.md), each helper's prompt (promptN.md: the brief
and its part's theme), the helpers' project check (chk.sh) and the blind reader's brief (READER.md).
Helpers that never open the repository write part*.jsonl there. `prepare` checks their lines,
keeps those of the brief's shape, and writes the reader's input under shuffled keys. `freeze`
writes the kept cases, each with the reader's label, into the corpus and records the set and its
sha256 in split.json. Each command prints counts and the hash only: no case, label or evidence,
so the session that runs them stays blind to the set until its one look
(`benchmarks/classifier.py --holdout NAME`). docs/design/classifier-evaluation.md has the procedure.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from operators.failures.cases import (  # noqa: E402
    CORPUS_DIR, HOLDOUT, SPLIT_FILE, CorpusError, load_cases, load_split, project_file, split_sha256,
)

CASE_KEYS = {"id", "project", "url", "label", "hard", "why", "evidence"}
EVIDENCE_KEYS = {"log_tail", "exit_code", "signal", "pod_reason", "pod_message", "termination_reason", "events"}
_PROJECT = re.compile(r"[\w.-]+/[\w.-]+")

HARVESTER_BRIEF = """\
### Harvesting real training failures for a frozen hold-out set ({name})

You help evaluate a failure classifier for distributed ML training jobs. It reads the evidence of a
failed job (mainly the tail of its log, sometimes an exit code or a Kubernetes pod reason) and says
whether the failure is **infra** or **user**:

- **infra**: the cause is outside the user's code, config and data: bad or faulty hardware (GPU Xid
  errors, ECC, a GPU falling off the bus, a bad node), the node's state (disk full on a shared node,
  /dev/shm too small on a managed platform), network or interconnect faults, preemption / spot
  reclaim / eviction, cloud capacity or quota shortages that clear, a transient outage or throttling
  of a service (object store 5xx/SlowDown, model hub 5xx, registry timeouts), a driver/runtime broken
  on the host by the platform. Retrying the same job later, or on healthy infrastructure, would succeed.
- **user**: the cause is the user's code, configuration, data or environment they control: a bug,
  a wrong argument, a shape mismatch, out of memory because the model/batch is too big for the
  hardware they chose, version mismatches of libraries they installed, bad data, missing files in
  their dataset, wrong credentials they configured. Retrying the same job unchanged fails the same way.

You harvest REAL cases from public GitHub issue threads, found with the `search` tool (corpus
`issues`) and read with `read_file` / `find_string`. Never invent, paraphrase or "clean up" a log;
never invent a URL or issue number: every case must come from a thread you actually read.

#### Rules (they keep the set honest; please follow them exactly)

1. Do NOT open any file under {repo} (the classifier, its corpus, its docs, its benchmarks):
   you must stay blind to how it decides. Only write under {workspace}/.
2. Projects: the case's GitHub project (owner/repo) must NOT appear (case-insensitive) in
   {workspace}/excluded.txt (projects already used). One case per project. Before you write a case,
   check {workspace}/claimed.txt; if the project is there, pick another; otherwise append the line
   `owner/repo` to it (`echo owner/repo >> {workspace}/claimed.txt`) at once, then write the case.
3. The label comes from the thread's diagnosis: what a maintainer or the reporter established as the
   cause (a fix in the user's code/config -> user; "bad node / hardware replaced / transient outage /
   worked on retry with nothing changed / provider capacity" -> infra). Skip threads with no clear
   diagnosis. Skip threads where the failure is not a job/run failing (feature requests, docs, install
   questions without a failing run are out; a failing training, fine-tuning, inference batch, data
   pipeline or cluster job is in).
4. The evidence is ONLY what the failed job itself printed or what the platform reported about it
   (log lines, traceback, error message, exit code, pod status), quoted verbatim from the thread,
   copied character for character (you may cut lines at the start to keep the most relevant tail,
   up to about 2000 characters; keep the final error lines and never cut lines at the end). Never
   include the diagnosis, a reply's words, or your own words in the evidence.
5. `hard` is true when the symptom points one way and the cause the other (e.g. a segfault that was
   a bad GPU; a "CUDA error" that was the user's wrong index; an NCCL timeout caused by a user's
   rank doing different work). Otherwise false.
6. Aim for variety and balance: roughly 40-60% infra. Do not pick cases because they look easy or
   hard for a keyword matcher; take threads as you find them when they meet the rules.

#### Output

Append one JSON object per line to YOUR file (named in your task), exactly these keys:

{{"id": "<owner>__<repo>-<issue number>", "project": "<owner>/<repo>", "url": "https://github.com/<owner>/<repo>/issues/<n>",
 "label": "infra" | "user", "hard": true | false, "why": "<one sentence: the cause the thread established>",
 "evidence": {{"log_tail": "<verbatim excerpt>", "exit_code": <int, only when the thread states it>}}}}

Other evidence keys allowed, only when the thread shows them verbatim: "signal" (e.g. "SIGKILL"),
"pod_reason" (e.g. "OOMKilled", "Evicted"), "pod_message", "termination_reason", "events"
([{{"reason": ..., "message": ...}}]). Validate each line with `python3 -c 'import json,sys; [json.loads(l) for l in open(sys.argv[1])]' FILE`.

At most {cases} cases, and no more than {lookups} look-ups (search, read_file, find_string calls) in all.

When done, report ONLY the number of cases, the counts infra/user/hard, and whether the file
validates: counts and nothing else, not even in general words (no remarks about any case, thread,
project, evidence or label).
"""

READER_BRIEF = """\
### Blind reading of failed training jobs

You are an expert in ML infrastructure (GPUs, clusters, distributed PyTorch, cloud platforms). For
each failed job in {workspace}/reader-input.jsonl you see only the evidence the job left: its log
tail, and sometimes an exit code, signal or Kubernetes pod reason. Say whether the failure is:

- **infra**: the cause is outside the user's code, config and data: faulty hardware (GPU Xid, ECC,
  a GPU off the bus, a bad node), the node's state, network/interconnect faults, preemption, spot
  reclaim or eviction, cloud capacity that clears, transient outage or throttling of a service
  (object store, model hub, registry), a host driver broken by the platform. Retrying the same job
  later or on healthy infrastructure would succeed.
- **user**: the cause is the user's code, configuration, data or environment they control: a bug,
  a wrong argument, shape mismatch, OOM because the model or batch is too big for the hardware
  they chose, versions of libraries they installed, bad data, missing files, credentials they set,
  quotas or resource requests they must change. Retrying unchanged fails the same way.

Rules: judge from the evidence alone, as an on-call engineer would when deciding whether to retry a
job automatically. Do NOT use the search, read_file, find_string or any web/issue tool, and do not
open any file other than {workspace}/reader-input.jsonl and READER.md, and never anything under
{repo}: you must not learn the thread or the label. Answer every case, even when unsure.

Write {workspace}/reader-output.jsonl: one line per input case, in input order:
{{"key": "<the key of the input line>", "label": "infra" | "user", "confidence": <0.5 to 1.0>, "why": "<a few words>"}}
Check that every key appears once. Report when done ONLY the counts of infra/user: counts and
nothing else, not even in general words (no remarks about any case).
"""


# One helper per theme (holdout24's pairs): each helper's prompt is the brief and its part below.
THEMES = (
    "GPU hardware and drivers; AMD ROCm/HIP and other accelerators",
    "HPC batch schedulers; MPI codes and launchers",
    "cloud storage and networking; dataset and model downloads",
    "experiment trackers and registries; LLM fine-tuning",
    "distributed PyTorch; large-model frameworks (DeepSpeed, Megatron/NeMo, Colossal-AI, Accelerate)",
    "containers and Kubernetes; Ray",
    "managed ML platforms (SageMaker, Vertex AI, Azure ML, Databricks, Colab, Kaggle); TPU/JAX/XLA",
    "workflow engines and data pipelines; batch inference and serving jobs",
)
PART = """

#### Your task

Your theme: **{theme}**. Your file: {workspace}/part{part}.jsonl (create it). To check projects before claiming, you may run `{workspace}/chk.sh owner/repo ...` (prints ok / EXCLUDED / CLAIMED).
"""
# The helpers' project check, in the workspace (they never open the repository).
CHECK = """\
#!/bin/bash
rc=0
for p in "$@"; do
 if grep -qixF -- "$p" {workspace}/excluded.txt; then echo "$p EXCLUDED"; rc=1; elif grep -qixF -- "$p" {workspace}/claimed.txt; then echo "$p CLAIMED"; rc=1; else echo "$p ok"; fi
done
exit $rc
"""


class HarvestError(ValueError):
    """The workspace, the reader's output or the corpus is not as the procedure needs it."""


def used_projects(corpus: Path) -> set[str]:
    """Every project of the corpus files and of split.json, lower-cased."""
    found = set()
    for path in corpus.glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                found.add(json.loads(line)["project"].lower())
    for value in json.loads((corpus / SPLIT_FILE).read_text(encoding="utf-8")).values():
        if isinstance(value, list):
            found.update(p.lower() for p in value)
    return found


def start(name: str, workspace: Path, corpus: Path, *, cases: int = 8, lookups: int = 70) -> str:
    """The workspace: the excluded projects, the brief, each helper's prompt (promptN.md: the brief
    and its part), the helpers' project check (chk.sh) and the reader's brief."""
    workspace.mkdir(parents=True, exist_ok=True)
    excluded = sorted(used_projects(corpus))
    (workspace / "excluded.txt").write_text("\n".join(excluded) + "\n")
    (workspace / "claimed.txt").touch()
    values = {"name": name, "workspace": workspace, "repo": ROOT, "cases": cases, "lookups": lookups}
    brief = HARVESTER_BRIEF.format(**values)
    (workspace / "brief.md").write_text(brief)
    for part, theme in enumerate(THEMES, 1):
        (workspace / f"prompt{part}.md").write_text(brief + PART.format(theme=theme, workspace=workspace, part=part))
    (workspace / "chk.sh").write_text(CHECK.format(workspace=workspace))
    (workspace / "chk.sh").chmod(0o755)
    (workspace / "READER.md").write_text(READER_BRIEF.format(**values))
    return f"{name}: {len(excluded)} projects excluded; briefs in {workspace} (one helper's prompt per part: prompt1.md ... prompt{len(THEMES)}.md)"


def check_line(row: object, excluded: set[str]) -> str | None:
    """Why a helper's line is dropped (a reason that quotes nothing of it), or None to keep it."""
    if not isinstance(row, dict) or set(row) != CASE_KEYS:
        return "keys"
    if row["label"] not in ("infra", "user") or not isinstance(row["hard"], bool):
        return "label or hard"
    if not isinstance(row["why"], str) or not row["why"].strip():
        return "why"
    evidence = row["evidence"]
    if (not isinstance(evidence, dict) or not set(evidence) <= EVIDENCE_KEYS
            or not isinstance(evidence.get("log_tail"), str) or not evidence["log_tail"].strip()):
        return "evidence"
    if "exit_code" in evidence and not isinstance(evidence["exit_code"], int):
        return "exit_code"
    project = row["project"]
    if not isinstance(project, str) or not _PROJECT.fullmatch(project):
        return "project"
    url = re.fullmatch(rf"https://github\.com/{re.escape(project)}/(?:issues|pull|discussions)/(\d+)(?:#\S*)?",
                       row["url"] if isinstance(row["url"], str) else "", re.IGNORECASE)
    if not url:
        return "url"
    if row["id"] != f"{project.replace('/', '__')}-{url.group(1)}":
        return "id"
    if project.lower() in excluded:
        return "excluded project"
    return None


def prepare(name: str, workspace: Path, seed: int) -> str:
    excluded = {line.strip().lower() for line in (workspace / "excluded.txt").read_text().splitlines() if line.strip()}
    kept, dropped, seen = [], {}, set()
    for path in sorted(workspace.glob("part*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            reason = check_line(row, excluded) if row is not None else "not JSON"
            if reason is None and row["project"].lower() in seen:
                reason = "project twice"
            if reason:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            seen.add(row["project"].lower())
            kept.append(row)
    (workspace / "cases.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    order = list(range(len(kept)))
    random.Random(seed).shuffle(order)
    keys = {f"k{n:03d}": kept[i]["id"] for n, i in enumerate(order)}
    (workspace / "reader-input.jsonl").write_text(
        "".join(json.dumps({"key": k, "evidence": kept[order[n]]["evidence"]}, ensure_ascii=False) + "\n"
                for n, k in enumerate(keys)), encoding="utf-8")  # fmt: skip
    (workspace / "keys.json").write_text(json.dumps(keys))
    infra, hard = sum(r["label"] == "infra" for r in kept), sum(r["hard"] for r in kept)
    return (f"{name}: kept {len(kept)} ({infra} infra / {len(kept) - infra} user, {hard} hard); "
            f"dropped {sum(dropped.values())} {dropped}; reader input under seed {seed}")


def reader_labels(workspace: Path) -> dict[str, dict]:
    """The reader's label of each case id; every key of keys.json exactly once."""
    keys = json.loads((workspace / "keys.json").read_text())
    labels: dict[str, dict] = {}
    for number, line in enumerate((workspace / "reader-output.jsonl").read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        key = row.get("key")
        if key not in keys or key in labels or row.get("label") not in ("infra", "user"):
            raise HarvestError(f"reader-output.jsonl line {number}: an unknown or repeated key, or a label not infra/user")
        labels[key] = {"label": row["label"], "confidence": float(row.get("confidence", 0.5))}
    if set(labels) != set(keys):
        raise HarvestError(f"reader-output.jsonl answers {len(labels)} of {len(keys)} keys")
    return {keys[k]: v for k, v in labels.items()}


def freeze(name: str, workspace: Path, corpus: Path) -> str:
    if not HOLDOUT.match(name):
        raise HarvestError(f"name={name!r}: a hold-out is named holdout<N>")
    split_path = corpus / SPLIT_FILE
    raw = json.loads(split_path.read_text(encoding="utf-8"))
    if name in raw:
        raise HarvestError(f"{name} is in split.json already")
    cases = [json.loads(line) for line in (workspace / "cases.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = reader_labels(workspace)
    paths = [corpus / project_file(case["project"]) for case in cases]
    if any(path.exists() for path in paths):
        raise HarvestError("a project of the set has a corpus file already")
    for case, path in zip(cases, paths):
        path.write_text(json.dumps({**case, "reader": labels[case["id"]]}, ensure_ascii=False) + "\n", encoding="utf-8")
    projects = sorted(case["project"] for case in cases)
    try:
        load_cases(paths)  # the corpus's own checks; its errors never quote a case
        split = load_split(corpus)
        split = replace(split, holdouts={**split.holdouts, name: tuple(projects)})  # the hash before split.json names the set
        digest = split_sha256(split, name, corpus)
    except CorpusError:
        for path in paths:
            path.unlink()
        raise
    raw |= {name: projects, f"{name}_sha256": digest}
    split_path.write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    infra, hard = sum(c["label"] == "infra" for c in cases), sum(c["hard"] for c in cases)
    said = sum(v["label"] == "infra" for v in labels.values())
    return (f"{name}: {len(cases)} cases ({infra} infra / {len(cases) - infra} user, {hard} hard); "
            f"reader {said} infra / {len(labels) - said} user; sha256 {digest}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("start", "prepare", "freeze"))
    parser.add_argument("name", help="the hold-out's name in split.json, e.g. holdout27")
    parser.add_argument("--workspace", type=Path, required=True, help="the folder the helpers and the reader share")
    parser.add_argument("--seed", type=int, help="prepare: the seed that shuffles the reader's keys")
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="corpus folder (default: the package's)")
    parser.add_argument("--lookups", type=int, default=70,
                        help="start: each helper's most look-ups, as the plan names it (default 70)")
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            if args.lookups < 1:
                parser.error(f"--lookups must be a positive number of look-ups, not {args.lookups}")
            print(start(args.name, args.workspace, args.corpus, lookups=args.lookups))
        elif args.command == "prepare":
            if args.seed is None:
                parser.error("prepare needs --seed (the plan names it before the harvest)")
            print(prepare(args.name, args.workspace, args.seed))
        else:
            print(freeze(args.name, args.workspace, args.corpus))
    except (HarvestError, CorpusError, OSError) as exc:
        print(f"benchmarks/holdout_harvest.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
