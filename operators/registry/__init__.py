"""The model registry: the promotion gate, versions and lineage, and the served model."""
