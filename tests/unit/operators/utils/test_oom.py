"""The kernel's OOM kill count, read from a cgroup v2 `memory.events` or `/proc/vmstat`."""

from __future__ import annotations

from pathlib import Path

from operators.utils.oom import oom_kill_count


def fake_proc(tmp_path: Path, cgroup: str, vmstat: str | None = "pgfault 10\noom_kill 7\n") -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if vmstat is not None:
        (proc / "vmstat").write_text(vmstat)
    return proc


def test_the_own_cgroup_v2_count_comes_first(tmp_path):
    root = tmp_path / "cgroup"
    (root / "system.slice" / "worker.service").mkdir(parents=True)
    (root / "system.slice" / "worker.service" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 3\noom_kill 3\n")
    proc = fake_proc(tmp_path, "0::/system.slice/worker.service\n")
    assert oom_kill_count(proc, root) == 3


def test_the_root_cgroup_falls_back_to_the_hosts_count(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    assert oom_kill_count(fake_proc(tmp_path / "a", "0::/\n"), root) == 7
    v1 = "4:memory:/\n0::/\n"
    assert oom_kill_count(fake_proc(tmp_path / "b", v1), root) == 7
    # a cgroup path that climbs out of the root, or a missing memory.events: the host's count
    assert oom_kill_count(fake_proc(tmp_path / "c", "0::/../../etc\n"), root) == 7
    assert oom_kill_count(fake_proc(tmp_path / "d", "0::/gone.slice\n"), root) == 7


def test_nothing_readable_is_none(tmp_path):
    assert oom_kill_count(fake_proc(tmp_path, "0::/\n", vmstat=None), tmp_path / "cgroup") is None
    assert oom_kill_count(fake_proc(tmp_path / "old", "0::/\n", vmstat="pgfault 10\n"), tmp_path / "cgroup") is None


def test_this_machine_has_a_count():
    assert isinstance(oom_kill_count(), int)


def test_cgroup_v1_sums_the_counts_below_its_own_cgroup(tmp_path):
    root = tmp_path / "cgroup"
    own = root / "memory" / "process_api" / "abc"
    for folder, count in ((own, 0), (own / "gang", 2), (own / "gang" / "rank1", 1), (root / "memory" / "other", 9)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n")
    proc = fake_proc(tmp_path, "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n")
    assert oom_kill_count(proc, root) == 3  # not the sibling's 9, not the host's 7
