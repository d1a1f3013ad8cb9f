"""Models that refuse what they do not know: a misspelt or foreign argument (one of ART's that
we name differently, say) fails by name instead of being dropped silently."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """Refuses a field it does not know, by name, and says what ours is called where ART's name
    differs (`ART_NAMES`), so a ported script never loses an argument silently."""

    model_config = ConfigDict(extra="forbid")
    ART_NAMES: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [key for key in data if key not in known]
            if unknown:
                hints = "; ".join(f"{key!r}: {cls.ART_NAMES[key]}" for key in unknown if key in cls.ART_NAMES)
                raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}"
                                 + (f" ({hints})" if hints else "")
                                 + f". Its fields: {', '.join(cls.model_fields)}.")
        return data
