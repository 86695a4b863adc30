r"""The settings every check runs with: the quick and thorough profiles, and how a user picks one.

`"quick"` (the default) runs 50 examples per invariant, the same every run;
`"thorough"` runs 300 random ones, for CI. `REFIMPL_TESTING_PROFILE=thorough`
switches the default for a whole session. No profile writes an example
database into the user's folder or times out a slow first call.
"""

from __future__ import annotations

import os

from hypothesis import settings as Settings

from .report import (
    COMMON_SETTINGS,
    resolved_settings,
)

__all__ = ["PROFILES", "QUICK", "THOROUGH", "kit_settings", "profile"]

# ---------------------------------------------------------------------------
# Settings profiles
# ---------------------------------------------------------------------------

#: Quick local runs: 50 examples per invariant, the same examples every run.
QUICK = Settings(max_examples=50, derandomize=True, **COMMON_SETTINGS)
#: Thorough runs (CI, before a release): 300 random examples per invariant.
THOROUGH = Settings(max_examples=300, derandomize=False, **COMMON_SETTINGS)
#: The profiles by name; `REFIMPL_TESTING_PROFILE` picks the default one.
PROFILES = {"quick": QUICK, "thorough": THOROUGH}

Settings.register_profile("refimpl-quick", QUICK)
Settings.register_profile("refimpl-thorough", THOROUGH)


def profile(name: str | Settings | None = None) -> Settings:
    """The Hypothesis settings a check runs with.

    `name` is `"quick"`, `"thorough"` or a `hypothesis.settings` object;
    `None` reads the environment variable `REFIMPL_TESTING_PROFILE`
    (default `"quick"`).
    """
    if isinstance(name, Settings):
        return name
    if name is None:
        name = os.environ.get("REFIMPL_TESTING_PROFILE", "quick")
    elif not isinstance(name, str):  # a list or a number is no profile name (and a list cannot be looked up)
        raise TypeError(f"settings must be a profile name ({' or '.join(repr(p) for p in sorted(PROFILES))}), a "
                        f"hypothesis.settings or None, got {type(name).__name__} {name!r:.60}")
    if name not in PROFILES:
        raise ValueError(f"settings must be one of {sorted(PROFILES)} or a hypothesis.settings, got {name!r}")
    return PROFILES[name]


def kit_settings(settings: str | Settings | None) -> Settings:
    """The Hypothesis settings a check runs with: a profile's name, your own `settings`, or the quick default."""
    return resolved_settings(profile(settings), QUICK)


