"""Configs built in code, for the checks of settings that need no file."""

from __future__ import annotations

from core.config import Config


def config_with(**settings) -> Config:
    """The default Config with `section__name=value` set (`train__precision="fp8"` sets
    config.train.precision); not validated."""
    config = Config()
    for key, value in settings.items():
        section, _, name = key.partition("__")
        setattr(getattr(config, section), name, value)
    return config
