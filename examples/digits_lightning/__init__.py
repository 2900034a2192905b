"""digits_lightning: a Lightning example for gangflow (pipelines/digits-lightning.yaml)."""
