"""Airflow triggers gangflow's deferrable operators defer to (they run in the triggerer)."""
