"""Lineage is real: the commit comes from git (with a dirty flag) or from the image's build arg,
and registration refuses an unknown commit unless explicitly allowed (real git repositories)."""

from __future__ import annotations

import re
import subprocess

import pytest

from operators.registry import lineage
from operators.registry.lineage import UnknownCommit, git_commit, git_dirty, require_commit

from pipeline_runs import PROJECT_ROOT


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv(lineage.COMMIT_ENV, raising=False)
    monkeypatch.delenv(lineage.DIRTY_ENV, raising=False)
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], cwd=tmp_path, check=True)
    return tmp_path


def test_a_checkout_gives_its_commit_and_whether_it_is_dirty(repo):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}", git_commit(repo)) and git_commit(repo) == head
    assert git_dirty(repo) == "false"
    (repo / "b.txt").write_text("untracked files do not make it dirty")
    assert git_dirty(repo) == "false"
    (repo / "a.py").write_text("x = 2\n")
    assert git_dirty(repo) == "true"


def test_the_projects_own_commit_is_known():
    assert re.fullmatch(r"[0-9a-f]{40}", git_commit(PROJECT_ROOT))


def test_an_image_has_no_git_but_its_build_arg(tmp_path, monkeypatch):
    monkeypatch.delenv(lineage.COMMIT_ENV, raising=False)
    assert git_commit(tmp_path) == "unknown" and git_dirty(tmp_path) == "unknown"
    monkeypatch.setenv(lineage.COMMIT_ENV, "0123abcd" * 5)
    monkeypatch.setenv(lineage.DIRTY_ENV, "false")
    assert git_commit(tmp_path) == "0123abcd" * 5 and git_dirty(tmp_path) == "false"


def test_registration_refuses_an_unknown_commit_unless_allowed(monkeypatch):
    monkeypatch.delenv(lineage.ALLOW_UNKNOWN_COMMIT_ENV, raising=False)
    with pytest.raises(UnknownCommit, match="GANGFLOW_GIT_COMMIT=.*Nothing was registered"):
        require_commit("unknown")
    assert require_commit("ab" * 20) == "ab" * 20
    monkeypatch.setenv(lineage.ALLOW_UNKNOWN_COMMIT_ENV, "1")
    assert require_commit("unknown") == "unknown"


def test_lineage_tags_and_git_commit():
    tags = lineage.lineage_tags({"dataset_version": "abc", "nested": {"a": 1}, "skip": None},
                                dag_id="d", dataset_version="ignored-default")
    assert tags == {"gangflow.dataset_version": "abc", "gangflow.nested": '{"a": 1}', "gangflow.dag_id": "d"}
    sha = lineage.git_commit(PROJECT_ROOT)
    assert sha == "unknown" or re.fullmatch(r"[0-9a-f]{40}", sha)
    assert lineage.git_commit("/") == "unknown"
