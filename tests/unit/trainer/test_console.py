"""trainer.console.say: a log line and its newline in one write (torchrun's tail forwards what it
reads, a partial line included, so a line written in two pieces can be split in the task log)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from trainer.console import say
from trainer.loop import Trainer


class _Raw(io.RawIOBase):
    """An unbuffered sink that records every write it receives."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)


def _unbuffered() -> tuple[io.TextIOWrapper, _Raw]:
    raw = _Raw()
    return io.TextIOWrapper(raw, write_through=True, encoding="utf-8"), raw  # as under PYTHONUNBUFFERED


def test_print_writes_a_line_in_two_pieces_and_say_in_one():
    stream, raw = _unbuffered()
    print("gangflow: progress: step 300/1500", file=stream, flush=True)
    assert raw.writes == [b"gangflow: progress: step 300/1500", b"\n"]  # what a tail can read between
    raw.writes.clear()
    say("gangflow: progress: step 300/1500", stream=stream)
    assert raw.writes == [b"gangflow: progress: step 300/1500\n"]


def test_the_trainers_log_lines_are_written_whole(monkeypatch):
    stream, raw = _unbuffered()
    monkeypatch.setattr("sys.stdout", stream)
    Trainer.log(SimpleNamespace(d=SimpleNamespace(is_main=True)), "gangflow: resuming from checkpoint step-50 (x)")
    assert raw.writes == [b"gangflow: resuming from checkpoint step-50 (x)\n"]
