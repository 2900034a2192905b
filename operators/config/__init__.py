"""Configuration: pipeline files, where state lives, the embedded defaults of one machine."""
