"""How a rule declares its parameters, the way node/config declares a config's sections:
a frozen dataclass whose annotations state each field's type, default and bounds once,
checked by pydantic. node/config checks a rule's parameters with the config and turns
the first problem into the one line that names the field, as for any other field.
(The two packages keep their own two-line helpers: this one loads torch with its
package, and the config must load without it.)

A field's rule takes its type strictly (YAML's `true` is no integer and "3" no number)
and says, in the user's words, what it allows: the error that names the field quotes
it, and the JSON Schema gives it to editors as the field's description. A check across
fields stays in `__post_init__` and starts its message with the field it blames
("k: got 9; allowed: ..."), which the error then names.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter

# Parameters refuse unknown keys and are checked again when handed over as a dataclass
# (built in code).
PARAMS = ConfigDict(extra="forbid", revalidate_instances="always")


def rule(allowed: str, **bounds: Any) -> Any:
    """A field's rule: its type taken strictly, `bounds` in pydantic's terms, and
    `allowed`, the rule in the user's words."""
    return Field(strict=True, description=allowed, **bounds)


def finite(allowed: str, **bounds: Any) -> Any:
    """`rule` for a number, which must also be finite."""
    return rule(allowed, allow_inf_nan=False, **bounds)


@functools.cache
def adapter(declared: Any) -> TypeAdapter[Any]:
    """The validator of a declared dataclass (or of one field's annotation), built once."""
    return TypeAdapter(declared)


def validated(declared: type, raw: dict[str, Any]) -> Any:
    """`declared` built from plain values; pydantic's ValidationError (a ValueError)
    names each broken field."""
    return adapter(declared).validate_python(raw)


def at_least(least: int) -> Any:
    """The rule of an integer >= `least`."""
    return rule(f"an integer >= {least}", ge=least)


Flag = Annotated[bool, rule("true or false")]
