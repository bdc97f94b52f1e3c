"""The one error type of configuration checks."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting.  ``str(err)`` is the single line shown to the user: the setting, the problem, the values and
    the fix."""

    def __init__(self, setting: str, problem: str, values: str, fix: str):
        self.setting = setting
        super().__init__(f"error: {setting}: {problem} ({values}); {fix}")
