"""The field validators every config and request type uses: one rule per kind of value, each error naming the
field and its limit in one form, `<where> '<field>' must be <limit>; got <value>` (the value cut short by
`brief`). Errors are FieldError (a ValueError carrying `.field`) or the subclass a caller passes as `error`
(SamplingParamsError, which the front doors map to an error's `param`). Core layer: imports nothing of ours."""
from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Collection
from typing import NoReturn


class FieldError(ValueError):
    """A value outside its limits; `field` names it, so callers report it without parsing the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def is_int(v: object) -> bool:
    """An int, not a bool."""
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def is_number(v: object) -> bool:
    """An int or a finite float, not a bool (an int is finite, even one too large for a float)."""
    if type(v) is float:
        return math.isfinite(v)
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def fail(name: str, limit: str, value: object, where: str = "field", error: type[FieldError] = FieldError) -> NoReturn:
    raise error(name, f"{where} {name!r} must be {limit}; got {brief(value)}")


def check(ok: bool, name: str, limit: str, value: object, where: str = "field",
          error: type[FieldError] = FieldError) -> None:
    """The rule for a value no check_* below covers: `ok` is the test, `limit` says it in words."""
    if not ok:
        fail(name, limit, value, where, error)


def check_int(name: str, value: object, low: int | None = None, high: int | None = None, *, where: str = "field",
              error: type[FieldError] = FieldError, optional: bool = False, limit: str | None = None) -> None:
    """An integer (not a bool) in [low, high], either bound left out when None; `optional`: None too."""
    if optional and value is None:
        return
    ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        fail(name, limit or _null(optional, "an integer" + _range(low, high, False)), value, where, error)


def check_number(name: str, value: object, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, where: str = "field", error: type[FieldError] = FieldError,
                 optional: bool = False, limit: str | None = None) -> None:
    """A finite int or float (not a bool) in [low, high] ((low, high] with low_open), a bound left out when None."""
    if optional and value is None:
        return
    ok = is_number(value) and (low is None or (value > low if low_open else value >= low)) \
        and (high is None or value <= high)
    if not ok:
        fail(name, limit or _null(optional, "a number" + _range(low, high, low_open)), value, where, error)


def check_choice(name: str, value: object, choices: Collection, *, where: str = "field",
                 error: type[FieldError] = FieldError) -> None:
    """One of `choices`."""
    if not any(value == c for c in choices):  # not `in`: a list from YAML is refused, never a TypeError
        fail(name, choice_text(choices), value, where, error)


def check_bool(name: str, value: object, *, where: str = "field", error: type[FieldError] = FieldError,
               optional: bool = False) -> None:
    """True or False (`optional`: or None); 1, 0 and "yes" are not."""
    if not (isinstance(value, bool) or (optional and value is None)):
        fail(name, _null(optional, "true or false"), value, where, error)


def check_str(name: str, value: object, *, where: str = "field", error: type[FieldError] = FieldError,
              optional: bool = False, empty: bool = False, what: str = "a string") -> None:
    """A str, non-empty unless `empty`; `optional`: or None. `what` says it in the message."""
    if optional and value is None:
        return
    if not (isinstance(value, str) and (empty or value != "")):
        fail(name, _null(optional, what if empty else f"a non-empty {what.removeprefix('a ')}"), value, where, error)


def choice_text(choices: Collection) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)


def _range(low: float | None, high: float | None, low_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    return "" if high is None else f" <= {high}"


def _null(optional: bool, text: str) -> str:
    return f"null or {text}" if optional else text


def brief(value: object, width: int = 80) -> str:
    """repr(value) cut to about `width` characters, built without ever forming the full repr: a long,
    huge or deeply nested value (from the wire: 1,000 levels of lists) costs O(width), never a
    RecursionError. Containers show their first items and their size."""
    s = _brief(value, width, 2)
    return s if len(s) <= width else s[:width - 3] + "..."


def _brief(v: object, width: int, depth: int) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 256 else f"<int of {v.bit_length()} bits>"
    if isinstance(v, (str, bytes, bytearray)):
        s = repr(v[:width])
        return s if len(v) <= width else f"{s}... ({len(v)} in all)"
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        name = type(v).__name__
        if depth == 0:
            return f"<{name} of {len(v)}>"
        items = v.items() if isinstance(v, dict) else v
        parts = []
        for item in itertools.islice(items, 8):
            parts.append(f"{_brief(item[0], 20, 0)}: {_brief(item[1], 20, depth - 1)}" if isinstance(v, dict)
                         else _brief(item, 20, depth - 1))
        more = f", ... ({len(v)} in all)" if len(v) > 8 else ""
        body = ", ".join(parts) + more
        if isinstance(v, list):
            return f"[{body}]"
        if isinstance(v, tuple):
            return f"({body}{',' if len(v) == 1 else ''})"
        return f"{{{body}}}" if isinstance(v, dict) or v else f"{name}()"
    if isinstance(v, numbers.Number):
        return repr(v)[:width]
    return f"<{type(v).__name__}>"
