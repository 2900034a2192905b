"""charlm: a Hugging Face Trainer example for gangflow (pipelines/charlm.yaml)."""
