"""The demo summary's `checkpoint_every_steps` and `checkpoint_interval_inputs` (issue 25.5): what
`auto` chose, read back from the run dir's metrics.jsonl; the asked integer otherwise."""

from __future__ import annotations

import json

from operators.cli.demo import checkpoint_interval


def test_auto_shows_the_last_choice_with_its_inputs(tmp_path):
    lines = [{"event": "tracking", "step": 0, "params": {}},
             {"event": "checkpoint_interval", "step": 20, "attempt": 1, "every_steps": 40, "seconds": 1.2, "cost_s": 0.01,
              "cost_source": "probe: x", "mtbf_s": 86400.0, "mtbf_source": "prior: y", "step_s": 0.03, "bound": None},
             {"event": "checkpoint_interval", "step": 60, "attempt": 2, "every_steps": 55, "seconds": 1.6, "cost_s": 0.02,
              "cost_source": "mlflow: z", "mtbf_s": 650.0, "mtbf_source": "history: w", "step_s": 0.03, "bound": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"event": "checkpoint_inter')
    shown = checkpoint_interval(tmp_path, "auto")
    assert shown["checkpoint_every_steps"] == 55
    assert shown["checkpoint_interval_inputs"] == {"cost_s": 0.02, "cost_source": "mlflow: z", "mtbf_s": 650.0,
                                                   "mtbf_source": "history: w", "step_s": 0.03, "seconds": 1.6, "bound": None,
                                                   "attempt": 2}


def test_an_integer_or_a_run_that_chose_nothing_shows_what_was_asked(tmp_path):
    assert checkpoint_interval(tmp_path, 50) == {"checkpoint_every_steps": 50, "checkpoint_interval_inputs": None}
    assert checkpoint_interval(tmp_path / "missing", "auto") == {"checkpoint_every_steps": "auto", "checkpoint_interval_inputs": None}
