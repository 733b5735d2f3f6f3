"""TOML and command-line text <-> typed config values: checking and converting one value to its field's
type (`coerce`), flattening nested tables to dotted keys, and writing a config dict as TOML."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from loom.errors import UserError


def flat_items(values: dict, prefix: str = ""):
    """A section's keys, nested tables joined with dots: `[model.moe] experts = 8` is `moe.experts`."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def coerce(name: str, value: Any, hint: Any, parse_text: bool) -> Any:
    """Convert `value` to the annotated type or raise a UserError naming field, value and valid form."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # e.g. int | Literal["auto"]: the first form the value takes
        for arg in typing.get_args(hint):
            try:
                return coerce(name, value, arg, parse_text)
            except UserError:
                pass
        forms = " or ".join("an integer" if a is int else "a number" if a is float else
                            " / ".join(map(str, typing.get_args(a))) if typing.get_origin(a) is Literal else str(a)
                            for a in typing.get_args(hint))
        raise UserError(f"{name}={value!r} is not valid; valid: {forms}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise UserError(f"{name}={value!r} is not valid; valid: {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(hint)
        if parse_text and isinstance(value, str):
            if any(part and not part.strip() for part in value.split(",")):  # e.g. rl.stop=<newline>
                raise UserError(f"{name}={value!r}: on the command line a list is comma-separated and each item "
                                "stripped of whitespace, so an item of only whitespace would be lost; write it in a "
                                f"TOML config instead (e.g. {name.rsplit('.', 1)[-1]} = [\"\\n\"])")
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, list):
            raise UserError(f"{name}={value!r} must be a list (comma-separated on the command line)")
        return [coerce(name, v, inner, parse_text) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if parse_text and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{name}={value!r} must be a boolean: true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if parse_text and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise UserError(f"{name}={value!r} must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if parse_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{name}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{name}={value!r} must be a string")
    raise TypeError(f"unsupported config type for {name}: {hint}")


def dumps_toml(data: dict) -> str:
    """Minimal TOML writer for our nested config dicts (tables of scalars and lists)."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        raise TypeError(f"cannot write {type(v)} to TOML")

    def pairs(values: dict, prefix: str = ""):  # a nested table as dotted keys (`moe.experts = 8`)
        for k, v in values.items():
            if isinstance(v, dict):
                yield from pairs(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k} = {scalar(v)}"

    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines.extend(pairs(values))
        lines.append("")
    return "\n".join(lines)
