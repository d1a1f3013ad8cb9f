"""Rewards for trajectory groups: RULER (an LLM judge ranking a group) and ways to combine it
with a programmatic reward. See `ruler` and `combine`."""

from art_integrations.rewards.combine import combine, combine_with_ruler
from art_integrations.rewards.ruler import (
    DEFAULT_RUBRIC,
    Judge,
    RulerError,
    RulerFailure,
    pop_ruler_failures,
    resolve_judge,
    ruler,
    ruler_failures,
    ruler_score_group,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "Judge",
    "RulerError",
    "RulerFailure",
    "combine",
    "combine_with_ruler",
    "pop_ruler_failures",
    "resolve_judge",
    "ruler",
    "ruler_failures",
    "ruler_score_group",
]
