"""What every config section shares: its keys and the checks its `validate` is made of.

A section is a dataclass of one component's settings. A field's key in TOML and overrides is its name,
unless metadata "key" spells it otherwise (`checkpoint.async` for the Python keyword); a field that is itself
a section nests its keys under its own (`model.moe.experts` is `ModelConfig.moe.experts`). The checks raise
a UserError naming `section.key`, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from loom.errors import UserError


def key_of(f: dataclasses.Field) -> str:
    """A field's key in TOML and overrides: its name, unless that is a Python keyword (metadata "key")."""
    return f.metadata.get("key", f.name)


def leaves(obj: "Section", key: str = "", path: str = ""):
    """(key, path, owner, field) for every value of a section, a nested section's under its name: key is the
    TOML key (`moe.experts`, `head_dim`), path the Python one (`moe.experts`, `explicit_head_dim`)."""
    for f in dataclasses.fields(obj):
        value = vars(obj)[f.name]
        if isinstance(value, Section):
            yield from leaves(value, f"{key}{key_of(f)}.", f"{path}{f.name}.")
        else:
            yield f"{key}{key_of(f)}", f"{path}{f.name}", obj, f


def flat_values(obj: "Section") -> dict[str, Any]:
    """Python path (`moe.experts`) -> value for every value of a section, nested sections' included."""
    return {path: vars(owner)[f.name] for _, path, owner, f in leaves(obj)}


class Section:
    """Base of every config section: `validate` checks the section's own fields (none by default)."""

    def validate(self) -> None:
        """Raise a UserError for the first impossible value; the defaults have none."""


def _check(section: str, obj: Section, names: tuple[str, ...], ok: Callable[[Any], bool], must: str) -> None:
    """UserError `section.key=value must ...` for the first field of `names` whose value fails `ok`."""
    keys = {f.name: key_of(f) for f in dataclasses.fields(obj)}
    values = vars(obj)
    for name in names:
        if not ok(values[name]):
            raise UserError(f"{section}.{keys[name]}={values[name]} {must}")


def positive(section: str, obj: Section, *names: str) -> None:
    _check(section, obj, names, lambda v: v > 0, "must be a positive integer")


def non_negative(section: str, obj: Section, *names: str) -> None:
    _check(section, obj, names, lambda v: v >= 0, "must be >= 0")


def finite_positive(section: str, obj: Section, *names: str) -> None:
    _check(section, obj, names, lambda v: v > 0 and math.isfinite(v), "must be a finite number > 0")


def finite_non_negative(section: str, obj: Section, *names: str) -> None:
    _check(section, obj, names, lambda v: v >= 0 and math.isfinite(v), "must be a finite number >= 0")


def below_one(section: str, obj: Section, *names: str) -> None:
    """Each value in [0, 1): a probability that must leave something (dropout, Adam's betas)."""
    _check(section, obj, names, lambda v: 0 <= v < 1, "must be in [0, 1)")


def unit_interval(section: str, obj: Section, *names: str) -> None:
    _check(section, obj, names, lambda v: 0 <= v <= 1, "must be in [0, 1]")
