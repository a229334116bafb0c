"""The tools' input schemas enforced, pure: the JSON Schema subset :mod:`proxy.mcp.tools` uses
(``type``, ``properties``, ``required``, ``additionalProperties: false``, ``enum``,
``minLength``/``maxLength``/``pattern``, ``minimum``/``maximum``, ``items``,
``minItems``/``maxItems``/``uniqueItems``), each violation told as a sentence naming the argument,
what it takes and what came, for the tool error (``isError: true``) the model reads to correct
its call (:func:`proxy.mcp.calls.call_tool`).

The schema a client is shown is the one enforced: one definition, no second list of rules.
Strings come back with NULs and lone surrogates replaced (SQLite and UTF-8 take neither); an
integer given as an integral number (``5.0``, as JSON Schema allows) comes back as an ``int``.
"""

from __future__ import annotations

import re
from typing import Any

_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


class ArgumentError(ValueError):
    """Arguments that do not satisfy a tool's input schema (or its further rules)."""

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.argument = argument


def kind_of(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def clean_string(text: str) -> str:
    """NULs to spaces, lone surrogates to '?' (as :func:`proxy.api.actions.clean_text`)."""
    return text.replace("\x00", " ").encode("utf-8", "replace").decode("utf-8")


def validate(schema: dict[str, Any], value: Any, path: str = "arguments") -> Any:
    """``value`` checked against ``schema``, cleaned (module docstring); an
    :class:`ArgumentError` at the first violation."""
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, value, path)
    if kind == "array":
        return _array(schema, value, path)
    if kind == "string":
        return _string(schema, value, path)
    if kind == "integer":
        return _integer(schema, value, path)
    if kind == "boolean":
        if not isinstance(value, bool):
            raise ArgumentError(f"{path} must be a boolean; got {kind_of(value)}.", path)
        return value
    raise AssertionError(f"unsupported schema type {kind!r} at {path}")  # a tool definition bug


def _object(schema: dict[str, Any], value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ArgumentError(f"{path} must be an object; got {kind_of(value)}.", path)
    props: dict[str, Any] = schema.get("properties", {})
    if schema.get("additionalProperties") is False:
        unknown = sorted(k for k in value if k not in props)
        if unknown:
            takes = ", ".join(props) or "nothing"
            raise ArgumentError(
                f"Unknown argument{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(k) for k in unknown)}: this tool takes {takes}.",
                unknown[0],
            )
    for name in schema.get("required", ()):
        if name not in value or value[name] is None:
            what = props.get(name, {}).get("description", "").split(".")[0]
            raise ArgumentError(f"{name} is required" + (f": {what}." if what else "."), name)
    out: dict[str, Any] = {}
    for name, item in value.items():
        if item is None and name not in schema.get("required", ()):
            continue  # an optional argument sent as null is an argument not sent
        sub = props.get(name)
        where = name if path == "arguments" else f"{path}.{name}"
        out[name] = validate(sub, item, where) if sub else item
    return out


def _array(schema: dict[str, Any], value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise ArgumentError(f"{path} must be an array; got {kind_of(value)}.", path)
    low, high = schema.get("minItems"), schema.get("maxItems")
    if low is not None and len(value) < low:
        raise ArgumentError(f"{path} must hold at least {low} item(s); got {len(value)}.", path)
    if high is not None and len(value) > high:
        raise ArgumentError(
            f"{path} holds {len(value)} items; at most {high} are accepted in one call.", path
        )
    items = schema.get("items")
    out = [validate(items, v, f"{path}[{i}]") for i, v in enumerate(value)] if items else value
    if schema.get("uniqueItems"):
        seen: set[Any] = set()
        for v in out:
            key = repr(v)
            if key in seen:
                raise ArgumentError(f"{path} lists {v!r} more than once.", path)
            seen.add(key)
    return out


def _string(schema: dict[str, Any], value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ArgumentError(f"{path} must be a string; got {kind_of(value)}.", path)
    text = clean_string(value)
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None and len(text) < low:
        raise ArgumentError(f"{path} must not be empty.", path)
    if high is not None and len(text) > high:
        raise ArgumentError(f"{path} is {len(text)} characters; at most {high} are accepted.", path)
    choices = schema.get("enum")
    if choices is not None and text not in choices:
        raise ArgumentError(f"{path} must be one of {', '.join(choices)}; got {text!r}.", path)
    pattern = schema.get("pattern")
    if pattern is not None and re.search(pattern, text) is None:
        rule = schema.get("description", f"a string matching {pattern}")
        raise ArgumentError(f"{path} {text!r} is not accepted: {rule}", path)
    return text


def _integer(schema: dict[str, Any], value: Any, path: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{path} must be an integer; got {kind_of(value)} {value!r}.", path)
    low, high = schema.get("minimum"), schema.get("maximum")
    if (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            span = f"from {low} to {high}"
        else:
            span = f"at least {low}" if low is not None else f"at most {high}"
        raise ArgumentError(f"{path} must be an integer {span}; got {value}.", path)
    return value
