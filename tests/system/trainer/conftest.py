"""The trainer tests' fixtures and helpers (tests/support/trainer_fixtures.py), shared by unit and system tests."""

from trainer_fixtures import *  # noqa: F401,F403
