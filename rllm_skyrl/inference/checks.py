"""Type and range checks for request fields, each failing with a 400 that names the field.

Every value a request hands to the generation thread passes one of these at the door, so none can
break a batched tensor op (an int64 overflow, a NaN) and fail the requests decoding with it. JSON
types are strict: ``true`` is not an integer, ``"false"`` not a boolean, ``5.0`` not a token id.
"""

from __future__ import annotations

import math
from typing import Any

from rllm_skyrl.inference.errors import ApiError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def bad(message: str) -> ApiError:
    return ApiError(400, message)


def shown(value: Any) -> str:
    """``repr`` of an offending value, cut short so a huge payload does not echo back."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    if not is_int(value) or not lo <= value <= hi:
        raise bad(f"{name} must be an integer in [{lo}, {hi}], got {shown(value)}")
    return value


def optional_integer(name: str, value: Any, lo: int, hi: int) -> int | None:
    return None if value is None else integer(name, value, lo, hi)


def number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    ok = (is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if ok:
        value = float(value)
        ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise bad(f"{name} must be a finite number in {span}, got {shown(value)}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {shown(value)}")
    return value


def integers(name: str, value: Any, lo: int, hi: int, *, max_len: int) -> list[int]:
    if not isinstance(value, list) or len(value) > max_len:
        raise bad(f"{name} must be a list of at most {max_len} integers, got {shown(value)}")
    for item in value:
        if not is_int(item) or not lo <= item <= hi:
            raise bad(f"{name} must hold integers in [{lo}, {hi}], got {shown(item)}")
    return value


def strings(name: str, value: Any, *, max_len: int, max_chars: int) -> list[str]:
    """A string, or a list of them (returned as a list)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > max_len:
        raise bad(f"{name} must be a string or a list of at most {max_len} strings, got {shown(value)}")
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= max_chars:
            raise bad(f"{name} must hold non-empty strings of at most {max_chars} chars, got {shown(item)}")
    return list(items)


def optional_string(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad(f"{name} must be a string, got {shown(value)}")
    return value
