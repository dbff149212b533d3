"""JSON as the commands print it: JSON has no NaN, so a number that could not be formed (an
interval over one seed, say) is null."""

from __future__ import annotations

import json
import math
from typing import Any


def json_ready(value: Any) -> Any:
    """`value` with every non-finite float (at any depth of dicts, lists and tuples) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def json_text(value: Any) -> str:
    """`value` as indented JSON, non-finite floats as null."""
    return json.dumps(json_ready(value), indent=2)
