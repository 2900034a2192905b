"""Re-fetch the vendored upstream CRDs (see README.md here). Needs network; CI never runs it.

    python operators/kubernetes/crds/refresh.py [--commit PROJECT=SHA ...] [--dry-run]

PROJECT is a key of SOURCES (jobset, kueue, trainer, volcano, kuberay, mpi-operator). The README's table is rewritten
from SOURCES so the recorded commits always match the files.
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

# project -> (GitHub repository, commit, folder, files): the one list of what is vendored.
SOURCES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "jobset": ("kubernetes-sigs/jobset", "08dfbdfd682714a9ab929633eca8dc95315187e7", "config/components/crd/bases", ("jobset.x-k8s.io_jobsets.yaml",)),
    "kueue": (
        "kubernetes-sigs/kueue",
        "ff69552e79ad21652c36caa97038382e55625cf7",
        "config/components/crd/bases",
        tuple(
            f"kueue.x-k8s.io_{p}.yaml"
            for p in ("admissionchecks", "clusterqueues", "localqueues", "multikueueclusters", "multikueueconfigs", "resourceflavors", "topologies", "workloadpriorityclasses", "workloads")
        ),
    ),
    "trainer": (
        "kubeflow/trainer",
        "8c0f5059bd51ec3ba6d6a6a7b2e1471de7bc13b3",
        "manifests/base/crds",
        tuple(f"trainer.kubeflow.org_{p}.yaml" for p in ("trainjobs", "clustertrainingruntimes", "trainingruntimes")),
    ),
    "volcano": (
        "volcano-sh/volcano",
        "ed72c7c815a9fd547a787134676f73d42e9d049c",
        "config/crd/volcano/bases",
        ("batch.volcano.sh_jobs.yaml", "scheduling.volcano.sh_podgroups.yaml", "scheduling.volcano.sh_queues.yaml"),
    ),
    "kuberay": ("ray-project/kuberay", "feeaf72facab4881ba2b179248bb67315634e229", "ray-operator/config/crd/bases", ("ray.io_rayjobs.yaml",)),
    "mpi-operator": ("kubeflow/mpi-operator", "caa3c47fc42eb762635f78045ec0fcd1a89eb038", "manifests/base", ("kubeflow.org_mpijobs.yaml",)),
}
_SHA = re.compile(r"^[0-9a-f]{40}$")


def _fetch(repo: str, commit: str, folder: str, name: str) -> bytes:
    url = f"https://raw.githubusercontent.com/{repo}/{commit}/{folder}/{name}"
    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 - fixed https host
        body = response.read()
    if b"kind: CustomResourceDefinition" not in body:
        raise SystemExit(f"{url}: not a CRD manifest")
    return body


def _rewrite_readme(sources) -> None:
    readme = HERE / "README.md"
    text = readme.read_text()
    for _, (repo, commit, folder, _files) in sources.items():
        text = re.sub(rf"(\| {re.escape(repo)} \({re.escape(folder)}\) \| )[0-9a-f]{{40}}", rf"\g<1>{commit}", text)
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", action="append", default=[], metavar="PROJECT=SHA", help=f"move a project ({', '.join(SOURCES)}) to a commit")
    parser.add_argument("--dry-run", action="store_true", help="print the URLs, write nothing")
    args = parser.parse_args(argv)
    sources = dict(SOURCES)
    for item in args.commit:
        project, _, sha = item.partition("=")
        if project not in sources or not _SHA.fullmatch(sha):
            parser.error(f"--commit {item!r}: PROJECT one of {', '.join(sources)}, SHA 40 hex digits")
        repo, _, folder, files = sources[project]
        sources[project] = (repo, sha, folder, files)
    for repo, commit, folder, files in sources.values():
        for name in files:
            if args.dry_run:
                print(f"https://raw.githubusercontent.com/{repo}/{commit}/{folder}/{name}")
                continue
            (HERE / name).write_bytes(_fetch(repo, commit, folder, name))
            print(f"refreshed {name} ({repo}@{commit[:12]})")
    if not args.dry_run:
        _rewrite_readme(sources)
        script = Path(__file__).resolve()
        text = script.read_text()
        for project, (_, commit, _, _) in sources.items():  # keep SOURCES the record of what is here
            text = text.replace(SOURCES[project][1], commit)
        script.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
