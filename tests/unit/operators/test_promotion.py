"""PromoteModelOperator against a real MLflow on a temporary SQLite store, with small models
trained here on the real digits split (tests/support/promotion_candidates.py). Two promotions
racing from separate processes: tests/system/operators/test_promotion_race.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from promotion_candidates import (DATASET_VERSION, FACTORY, TEST_SPLIT, TRAIN_SPLIT, make, manifest,  # noqa: F401 (fixtures)
                                  weights)

from operators.exceptions import RegistryUnavailable, UserError
from operators.promotion import PromoteModelOperator
from operators.registry import lineage
from operators.registry import versions as registry
from trainer.datastore import file_md5

pytestmark = pytest.mark.usefixtures("digits")  # data/digits, built when missing (a fresh clone)


@pytest.fixture(autouse=True)
def _allow_test_model(monkeypatch):
    """The candidates' factory is allowed the way a deployment allows one (the env var)."""
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", FACTORY)


RESULT_KEYS = {"promoted", "reason", "model_name", "model_version", "candidate_accuracy", "champion_version",
               "champion_accuracy"}


def test_template_fields_cover_every_argument():
    assert set(PromoteModelOperator.template_fields) == {
        "model_name", "model_uri", "dataset", "mlflow_run_id", "candidate_metrics", "floor", "min_improvement",
        "lineage", "tracking_uri", "allowed_models", "data_factory"}


def test_a_model_of_other_data_is_refused_before_anything_is_registered(client, make):
    """Issue 13: a candidate trained on another dataset's columns was registered as a version of
    the champion's model, then failed: an orphan version with no decision tags."""
    from operators.registry.versions import SchemaMismatch

    name = "digits-schema"
    champion = make("schema-champion", "ok")
    assert champion.promote(name)["promoted"]
    other = make("schema-other", "good")
    wine = {c: "float32" for c in ("alcohol", "malic_acid", "ash")} | {"label": "int64"}
    with pytest.raises(SchemaMismatch) as caught:
        other.promote(name, dataset=manifest() | {"schema": wine})
    assert str(caught.value).startswith("expected columns [pixel_00, pixel_01,")
    assert "got [alcohol, malic_acid, ash]" in str(caught.value) and "Nothing was registered" in str(caught.value)
    versions = client.search_model_versions(f"name='{name}'")
    assert [str(v.version) for v in versions] == ["1"]  # no orphan version


def test_promotion_lifecycle(client, make):
    name = "digits"
    ok = make("ok", "ok")
    assert 0.85 < ok.metrics["accuracy"] < 0.95

    # 1. First candidate, no champion: promoted.
    first = ok.promote(name)
    assert set(first) >= RESULT_KEYS
    assert first["promoted"] is True and first["model_version"] == "1" and first["model_name"] == name
    assert first["champion_version"] is None and first["champion_accuracy"] is None
    assert first["candidate_accuracy"] == ok.metrics["accuracy"]
    assert "no champion yet" in first["reason"]
    assert str(registry.current_champion(client, name).version) == "1"
    v1 = client.get_model_version(name, "1")
    assert v1.tags["gangflow.decision"] == "promoted"
    assert v1.tags["gangflow.candidate_accuracy"] == f"{ok.metrics['accuracy']:.6f}"
    assert v1.tags["gangflow.champion_version"] == "none"
    # Lineage.
    assert v1.tags["gangflow.dataset_version"] == DATASET_VERSION
    assert v1.tags["gangflow.model_uri"] == ok.model_uri
    assert v1.tags["gangflow.dag_id"] == "gangflow_train"
    assert v1.tags["gangflow.dag_run_id"] == "manual__ok"
    assert v1.tags["gangflow.try_number"] == "1"
    assert v1.tags["gangflow.mlflow_run_id"] == ok.mlflow_run_id == v1.run_id
    assert v1.tags["gangflow.git_commit"] == lineage.git_commit()
    assert v1.tags["gangflow.test_data_md5"] == file_md5(TEST_SPLIT)
    assert v1.tags["gangflow.card_data_train_md5"] == file_md5(TRAIN_SPLIT)
    assert v1.tags["gangflow.card_model_factory"].endswith(":tiny_mlp")

    # 2. The same task retried after the alias moved: same version, promoted, nothing re-decided.
    retry = ok.promote(name, try_number=2)
    assert retry["promoted"] is True and retry["model_version"] == "1" and retry["reason"] == first["reason"]
    assert retry["champion_version"] is None and retry["candidate_accuracy"] == first["candidate_accuracy"]
    assert len(client.search_model_versions(f"name='{name}'")) == 1

    # 3. Identical training re-run (the second `make demo`): equal scores, NOT promoted.
    same = make("ok-again", "ok")
    tie = same.promote(name)
    assert tie["promoted"] is False and tie["model_version"] == "2"
    assert tie["champion_version"] == "1" and tie["champion_accuracy"] == ok.metrics["accuracy"]
    assert tie["candidate_accuracy"] == tie["champion_accuracy"]
    assert "does not beat champion v1" in tie["reason"]
    assert str(registry.current_champion(client, name).version) == "1"
    v2 = client.get_model_version(name, "2")
    assert v2.tags["gangflow.decision"] == "rejected" and v2.tags["gangflow.reason"] == tie["reason"]
    assert v2.tags["gangflow.champion_version"] == "1"
    assert v2.tags["gangflow.champion_accuracy"] == f"{ok.metrics['accuracy']:.6f}"
    assert client.get_registered_model(name).tags["gangflow.last_decision"] == f"v2 rejected: {tie['reason']}"

    # 4. A bad model: below the floor, NOT promoted, and not a task failure.
    bad = make("bad", "bad")
    low = bad.promote(name)
    assert low["promoted"] is False and "below the floor 0.5000" in low["reason"]
    assert str(registry.current_champion(client, name).version) == "1"

    # 5. A better model: promoted; the champion was re-evaluated on the same split.
    good = make("good", "good")
    win = good.promote(name)
    assert win["promoted"] is True and win["model_version"] == "4"
    assert win["champion_version"] == "1" and win["champion_accuracy"] == ok.metrics["accuracy"]
    assert win["candidate_accuracy"] == good.metrics["accuracy"] > ok.metrics["accuracy"]
    assert "beats champion v1" in win["reason"]
    assert str(registry.current_champion(client, name).version) == "4"
    assert "Champion: v4" in client.get_registered_model(name).description

    # 6. A worse model than the new champion (ok beat the floor, not v4): NOT promoted.
    worse = make("ok-3", "ok")
    lose = worse.promote(name, min_improvement="0.0")
    assert lose["promoted"] is False and lose["champion_version"] == "4"
    assert str(registry.current_champion(client, name).version) == "4"


def test_min_improvement_blocks_a_small_gain(client, make):
    name = "digits-margin"
    make("m-ok", "ok").promote(name)
    result = make("m-good", "good").promote(name, min_improvement=0.5)
    assert result["promoted"] is False
    assert "minimum improvement 0.5000" in result["reason"]


def test_templated_gate_values_and_missing_candidate_metrics(client, make):
    cand = make("tmpl", "ok")
    # Rendered templates arrive as strings; no candidate metrics: the operator evaluates itself.
    result = cand.promote("digits-templated", floor="0.5", min_improvement="0.01", candidate_metrics=None)
    assert result["promoted"] is True
    assert result["candidate_accuracy"] == cand.metrics["accuracy"]


def test_candidate_metrics_of_another_test_file_are_recomputed(client, make):
    cand = make("other-split", "ok")
    stale = dict(cand.metrics, accuracy=0.99, test_md5="0" * 32)
    result = cand.promote("digits-stale", candidate_metrics=stale)
    assert result["candidate_accuracy"] == cand.metrics["accuracy"]


def test_promote_registers_the_model_training_logged_and_logs_nothing_again(client, make, caplog, monkeypatch):
    """Issue 21.3: the model goes to MLflow once; promote registers that URI (no re-upload) and
    MLflow's validation of a serving input example is not run (it warned of the allow-list)."""
    import logging

    mlflow_log = logging.getLogger("mlflow")  # does not propagate to the root logger caplog listens on
    mlflow_log.addHandler(caplog.handler)
    try:
        cand = make("once", "ok")
        caplog.set_level(logging.WARNING)
        legacy = make("once-legacy", "ok")
        # Allowed by the pipeline (allowed_models), not by the worker's environment: MLflow's own
        # validation load of a serving input (Model.log) was refused and warned about that.
        monkeypatch.delenv("GANGFLOW_ALLOWED_MODELS")
        allowed = [FACTORY]
        result = cand.promote("digits-once", allowed_models=allowed)
        legacy.model_uri = f"runs:/{legacy.mlflow_run_id}/final"
        client.log_artifacts(legacy.mlflow_run_id, str(legacy.run_dir / "final"), "final")
        legacy.promote("digits-once-legacy", allowed_models=allowed)
    finally:
        mlflow_log.removeHandler(caplog.handler)
    version = client.get_model_version("digits-once", result["model_version"])
    assert version.source == cand.model_uri
    assert [o.model_id for o in client.get_run(cand.mlflow_run_id).outputs.model_outputs] == [cand.model_id]
    assert "Failed to validate serving input example" not in caplog.text


def test_a_run_from_before_the_logged_model_still_promotes(client, make):
    """A DAG run in flight at the upgrade returned `runs:/<id>/final`: promote logs it itself."""
    cand = make("legacy", "ok")
    cand.model_uri = f"runs:/{cand.mlflow_run_id}/final"
    client.log_artifacts(cand.mlflow_run_id, str(cand.run_dir / "final"), "final")
    result = cand.promote("digits-legacy")
    assert result["promoted"] and client.get_model_version("digits-legacy", "1").source.startswith("models:/m-")


def test_bad_gate_values(make):
    with pytest.raises(ValueError, match=r"floor=1.5: must be a number in \[0, 1\]"):
        PromoteModelOperator(task_id="p", model_name="m", model_uri="runs:/x/final", dataset={}, mlflow_run_id="x",
                             floor=1.5)
    cand = make("bad-gate", "ok")
    with pytest.raises(UserError, match="min_improvement='lots'"):
        cand.promote("digits-bad-gate", min_improvement="lots")
    with pytest.raises(UserError, match=r"floor=2.0: must be a number in \[0, 1\]"):
        cand.promote("digits-bad-gate", floor="2.0")


def test_subclass_gates_on_macro_f1(client, make):
    class F1Gate(PromoteModelOperator):
        metric_name = "macro_f1"

        def score(self, metrics):
            return float(metrics["macro_f1"])

    cand = make("f1", "ok")
    result = F1Gate(task_id="promote", model_name="digits-f1", model_uri=cand.model_uri, dataset=manifest(),
                    mlflow_run_id=cand.mlflow_run_id, candidate_metrics=cand.metrics, floor=0.5
                    ).execute(cand.context())
    assert result["metric"] == "macro_f1" and result["candidate_score"] == cand.metrics["macro_f1"]
    assert result["candidate_accuracy"] == cand.metrics["accuracy"]
    tags = client.get_model_version("digits-f1", "1").tags
    assert tags["gangflow.candidate_macro_f1"] == f"{cand.metrics['macro_f1']:.6f}"
    assert tags["gangflow.gate_metric"] == "macro_f1"


def test_champion_that_cannot_be_evaluated_fails_the_task(client, make, monkeypatch):
    name = "digits-broken-champion"
    # An allowed factory whose module is gone (removed after the champion was promoted).
    monkeypatch.setenv("GANGFLOW_ALLOWED_MODELS", f"{FACTORY},gangflow_no_such_module:mlp")
    broken = make("broken", "ok", factory="gangflow_no_such_module:mlp")
    # Register and crown it directly (as if the factory was removed after it was promoted).
    version = registry.register_version(client, name, run_id=broken.mlflow_run_id,
                                        source_dir_or_artifact_path=broken.run_dir / "final")
    registry.promote(client, version)
    with pytest.raises(registry.ChampionEvaluationFailed, match="cannot evaluate champion"):
        make("after-broken", "good").promote(name)
    assert str(registry.current_champion(client, name).version) == "1"


def test_a_champion_whose_card_names_arbitrary_code_is_refused_and_nothing_is_promoted(client, make, tmp_path):
    """12.1, the attack: anyone who can reach the registry registers a version whose model card
    names `subprocess:run` and sets @champion on it; the next promote must not run it."""
    name = "digits-attacked"
    proof = tmp_path / "pwned"
    evil = make("evil", "ok")
    card = json.loads((evil.run_dir / "final" / "model_card.json").read_text())
    card["model"] = {"factory": "subprocess:run", "kwargs": {"args": ["sh", "-c", f"id > {proof}"]}}
    (evil.run_dir / "final" / "model_card.json").write_text(json.dumps(card))
    client.log_artifacts(evil.mlflow_run_id, str(evil.run_dir / "final"), "attack")
    version = registry.register_version(
        client, name, run_id=evil.mlflow_run_id,
        source_dir_or_artifact_path=f"{client.get_run(evil.mlflow_run_id).info.artifact_uri}/attack")
    registry.promote(client, version)

    good = make("after-attack", "good")
    with pytest.raises(registry.ChampionEvaluationFailed,
                       match=r"refusing to load champion digits-attacked v1: .*model\.factory='subprocess:run' "
                             r"is not an allowed model architecture; nothing was imported.*Nothing was promoted"):
        good.promote(name)
    assert not proof.exists(), f"the champion's card ran code: {proof.read_text()}"
    assert str(registry.current_champion(client, name).version) == "1"  # no alias move
    assert not client.get_model_version(name, "2").tags.get("gangflow.decision") == "promoted"


def test_missing_final_weights_is_a_user_error(client, make):
    cand = make("never-logged", "ok")
    with pytest.raises(UserError, match=rf"no model at runs:/{cand.mlflow_run_id}/nothing"):
        cand.promote("digits-missing", model_uri=f"runs:/{cand.mlflow_run_id}/nothing")
    assert registry.current_champion(client, "digits-missing") is None


def test_a_test_split_that_differs_from_the_manifest_is_refused(client, make, tmp_path):
    """12.7: promote scores on the validated bytes only (the champion's re-scoring included)."""
    from operators.exceptions import DatasetHashMismatch

    cand = make("tampered-split", "ok")
    tampered = tmp_path / "test.parquet"
    tampered.write_bytes(TEST_SPLIT.read_bytes() + b"\0")
    with pytest.raises(DatasetHashMismatch, match=r"test split of dataset version d82dc74b\w+: md5 \w{32}, but the "
                                                 r"validated manifest says test_md5 " + manifest()["test_md5"]):
        cand.promote("digits-tampered", dataset=manifest() | {"test_path": str(tampered)})
    assert registry.current_champion(client, "digits-tampered") is None


def test_unreachable_registry_is_retryable(make, monkeypatch):
    cand = make("offline", "ok")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(RegistryUnavailable, match=r"http://127\.0\.0\.1:9") as info:
        cand.promote("digits-offline", tracking_uri="http://127.0.0.1:9")
    assert info.value.retryable


def test_move_champion_is_a_compare_and_set(client, make):
    name = "digits-cas"
    first = make("cas-1", "ok")
    first.promote(name)
    v1 = registry.current_champion(client, name)
    v2 = registry.register_version(client, name, run_id=make("cas-2", "good").mlflow_run_id,
                                   source_dir_or_artifact_path=first.run_dir / "final")
    # Decided against "no champion", but v1 is champion now: nothing moves.
    assert registry.move_champion(client, v2, expected=None) == (False, v1) or \
        registry.current_champion(client, name).version == v1.version
    assert str(registry.current_champion(client, name).version) == "1"
    # The same version with another recorded score is a change too.
    client.set_model_version_tag(name, "1", "gangflow.candidate_accuracy", "0.100000")
    moved, now = registry.move_champion(client, v2, expected=v1)
    assert not moved and str(now.version) == "1"
    moved, _ = registry.move_champion(client, v2, expected=registry.current_champion(client, name))
    assert moved and str(registry.current_champion(client, name).version) == "2"


def test_the_dataset_lineage_comes_from_the_manifest_only():
    """One route: the validate task's manifest, over `lineage` (the run's own tags come first)."""
    op = PromoteModelOperator(task_id="promote", model_name="m", model_uri="runs:/r/final", dataset={},
                              mlflow_run_id="r", lineage={"dataset_version": "f" * 32, "train_try_number": 2})
    manifest = {"version": "a" * 32, "train_md5": "b" * 32, "test_md5": "c" * 32}
    tags = op.lineage_for({}, {}, Path("/nonexistent"), manifest)
    assert tags["gangflow.dataset_version"] == "a" * 32 and tags["gangflow.dataset_md5"] == "b" * 32
    assert tags["gangflow.test_data_md5"] == "c" * 32 and tags["gangflow.train_try_number"] == "2"


def test_a_bad_metrics_setting_is_refused_before_anything_is_promoted(monkeypatch):
    """The metrics settings were read only after @champion had moved: promoted, then the task failed."""
    import operators.evaluation as evaluation

    monkeypatch.setenv("GANGFLOW_METRICS", "127.0.0.1:notaport")
    monkeypatch.setattr(evaluation, "manifest_of", lambda dataset: pytest.fail("promote went on past a bad setting"))
    op = PromoteModelOperator(task_id="promote", model_name="m", model_uri="runs:/r/final", dataset={}, mlflow_run_id="r")
    with pytest.raises(UserError, match="GANGFLOW_METRICS='127.0.0.1:notaport'"):
        op.execute({"ti": None, "run_id": "r"})
