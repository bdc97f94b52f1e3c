"""The one error type of configuration checks."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A bad setting, flag or input file.  ``str(err)`` is the single line shown to the user: the setting, the
    problem, the values and the fix; each part is kept, for callers that report it differently (a warning)."""

    def __init__(self, setting: str, problem: str, values: str, fix: str):
        self.setting, self.problem, self.values, self.fix = setting, problem, values, fix
        super().__init__(f"error: {setting}: {problem} ({values}); {fix}")

    def __reduce__(self):
        # Rebuilt from its parts: a worker process's error (prepare's tokenising pool) reaches the parent intact.
        return type(self), (self.setting, self.problem, self.values, self.fix)


def nearest(key: str, valid: list[str]) -> str:
    """The valid name closest to a mistyped one (for "did you mean" fixes)."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return match[0] if match else valid[0]
