"""The launcher's name, which starts its messages, and the error of a bad configuration."""

from __future__ import annotations

PROG = "sumflow-run"


class ConfigError(Exception):
    """A bad configuration, found before anything starts. The message is the reason."""
