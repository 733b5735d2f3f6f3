"""What every config section shares: its keys and the checks its `validate` is made of.

A section is a dataclass of one component's settings. A field's key in TOML and overrides is its name,
unless metadata "key" spells it otherwise (`model.moe.experts` for `moe_experts`, `checkpoint.async` for
the Python keyword). The checks raise a UserError naming `section.key`, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from loom.errors import UserError


def key_of(f: dataclasses.Field) -> str:
    """A field's key in TOML and overrides: its name, unless that is a Python keyword (metadata "key")."""
    return f.metadata.get("key", f.name)


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
