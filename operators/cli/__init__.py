"""Command-line programs: `make demo`, `make setup`, `make ui`, the render CLI and the cluster drill."""
