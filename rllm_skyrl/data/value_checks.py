"""What a number, and a list of numbers, may be in a trajectory (``trajectory_checks`` lists what is
accepted), and the error every trajectory check raises.

A list is read into a buffer by C code that refuses what is not an integer / real number
(``array.fromlist``, ``struct``: a few ns an element) and checked with a few numpy reductions, many
lists at once; only elements worth 0 or 1, the values a ``bool`` can take, are looked at one by one.
"""

from __future__ import annotations

import math
import operator
import struct
from array import array
from typing import Any

import numpy as np
import torch

_INT64_LIMIT = 2**63
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_PLAIN_NUMBERS = frozenset({int, float})
_REAL = struct.Struct("d")


class MalformedTrajectoryError(ValueError):
    """A trajectory that cannot become a training row; names the item, the field and the fix."""

    def __init__(self, label: str, step_index: int | None, field_name: str, problem: str, remedy: str):
        where = label if step_index is None else f"{label} step {step_index}"
        super().__init__(f"{where}, {field_name}: {problem}; {remedy}")
        self.step_index = step_index
        self.field_name = field_name


def show(value: Any) -> str:
    """A short, unambiguous rendering of a bad value for a message: repr, and the type when unclear."""
    try:
        text = repr(value)
    except Exception:  # a message must not fail on the value it describes
        text = "<unprintable>"
    text = text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, str | int | float | type(None)) and not isinstance(value, bool):
        return text
    return f"{text} ({type(value).__name__})"


def is_bool(value: Any) -> bool:
    if isinstance(value, bool | np.bool_):
        return True
    dtype = getattr(value, "dtype", None)
    return (isinstance(value, np.ndarray) and dtype == np.bool_) or (
        isinstance(value, torch.Tensor) and dtype == torch.bool
    )


def _packs(value: Any, code: str) -> bool:
    """Whether ``struct`` takes ``value`` as an integer (``code="q"``: ``operator.index``) or a real
    number (``"d"``: ``float()`` of a non-text value)."""
    try:
        struct.pack(code, value)
    except Exception:  # struct.error, or whatever a value's own __index__ / __float__ raised
        return False
    return True


def _read(label: str, index: int | None, name: str, value: Any, code: str, remedy: str) -> bytes:
    """``value``, a list, tuple or 1-D numpy array, as int64 (``code="q"``) or float64 (``"d"``) bytes;
    ``remedy`` is said when it is none of these."""
    if isinstance(value, list | tuple):
        try:  # a bound Struct.pack copies the list once, struct.pack(fmt, ...) twice (a tenth more)
            return struct.Struct(f"{len(value)}{code}").pack(*value)
        except Exception:  # the first element struct refuses on its own is the one named
            position, item = next((i, item) for i, item in enumerate(value) if not _packs(item, code))
            problem = f"element {position} is {show(item)}"
            fix = "token ids must be integers (int or numpy integer)"
            fix = fix if code == "q" else "values must be real numbers (float or int)"
            raise MalformedTrajectoryError(label, index, name, problem, fix) from None
    what, kinds, dtype = ("integer", "iu", np.int64) if code == "q" else ("number", "iuf", np.float64)
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in kinds:
        return value.astype(dtype).tobytes()
    if isinstance(value, np.ndarray):
        problem = f"is a numpy array of dtype {value.dtype} and shape {value.shape}, not a 1-D {what} array"
    else:
        problem = f"is {show(value)}, not a list of {what}s"
    raise MalformedTrajectoryError(label, index, name, problem, remedy)


def _real_trouble(low: float, high: float, at_most: float) -> str | None:
    """Which rule real numbers whose least is ``low`` and greatest ``high`` break (NaN when one is
    NaN, as numpy's reductions give it), as the end of "is <value>"; ``None`` when they keep every
    rule. One number is checked as ``low = high``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return ""
    if low < -_FLOAT32_MAX or high > _FLOAT32_MAX:
        return ", outside float32's range"
    return f", above {at_most}" if high > at_most else None


def real_scalar(label: str, index: int | None, name: str, value: Any, remedy: str) -> float:
    """One finite real number (see ``trajectory_checks``), as a Python float."""
    number = value if type(value) is float else None
    if number is None and not is_bool(value):
        try:
            number = _REAL.unpack(_REAL.pack(value))[0]
        except Exception:  # struct.error, or whatever the value's own __float__ raised
            pass
    if number is None:
        raise MalformedTrajectoryError(label, index, name, f"is {show(value)}, not a number", remedy)
    trouble = _real_trouble(number, number, math.inf)
    if trouble is not None:
        raise MalformedTrajectoryError(label, index, name, f"is {number}{trouble}", remedy)
    return number


class _Lists:
    """Lists of numbers read end to end: list ``i`` is ``values(i, i + 1)``.

    A subclass stores them (``_values``: all as one array) and ``breach(first, stop)`` gives the first
    rule those lists break: a bool among them (its position and itself), or a word that ``named``
    turns into the last list's problem and fix; ``None`` when they keep every rule.
    """

    not_bool: str

    def __init__(self) -> None:
        self.lists: list[Any] = []
        self.bounds = [0]

    def _count(self, value: Any) -> None:
        self.lists.append(value)
        self.bounds.append(self.bounds[-1] + len(value))

    def values(self, first: int = 0, stop: int | None = None) -> np.ndarray:
        """Lists ``first`` to ``stop`` (default: the last) end to end."""
        stop = len(self.lists) if stop is None else stop
        return self._values()[self.bounds[first] : self.bounds[stop]]

    def truncate(self, count: int) -> None:
        del self.lists[count:], self.bounds[count + 1 :]

    def first_bool(self, first: int, flagged: np.ndarray) -> tuple[int, Any] | None:
        """The first ``flagged`` element (one worth 0 or 1, from list ``first`` on) that is a bool,
        as its position in its list and itself. One pass over the flagged elements of every list: a
        small vocabulary's ids 0 and 1 flag an element in nearly every prompt."""
        positions = np.flatnonzero(flagged) + self.bounds[first]
        owners = np.searchsorted(self.bounds, positions, side="right") - 1
        for position, owner in zip(positions.tolist(), owners.tolist(), strict=True):
            item = self.lists[owner][position - self.bounds[owner]]
            if type(item) not in _PLAIN_NUMBERS and is_bool(item):
                return position - self.bounds[owner], item
        return None

    def check_last(self, label: str, index: int | None, name: str) -> None:
        """Raise the first problem of the list read last, naming its element."""
        breach = self.breach(len(self.lists) - 1)
        if isinstance(breach, tuple):
            problem = f"element {breach[0]} is {breach[1]!r} (a bool)"
            raise MalformedTrajectoryError(label, index, name, problem, self.not_bool)
        if breach is not None:
            raise MalformedTrajectoryError(label, index, name, *self.named(breach))


class IdLists(_Lists):
    """Token ids as int64. ``fast``: a plain list is read by ``array.fromlist``, the fastest reader
    of Python ints (3.7 ns an id, ``struct`` 9), which takes ids of 2**63 and more (negative as
    int64: outside every vocabulary) and refuses negative ones (read by ``struct`` then). Otherwise
    an id beyond int64 is refused as an element, as the message names it."""

    not_bool = "token ids must be integers, not bool"

    def __init__(self, vocab_size: int | None, fast: bool = False) -> None:
        super().__init__()
        self.buffer = array("Q")  # read as int64; "Q" is what array.fromlist reads fastest
        self.fast = fast
        self.limit = _INT64_LIMIT if vocab_size is None else min(vocab_size, _INT64_LIMIT)
        self.span = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"

    def read(self, label: str, index: int | None, name: str, value: Any) -> None:
        if self.fast and type(value) is list:
            try:
                self.buffer.fromlist(value)  # appends nothing when it refuses an element
                return self._count(value)
            except Exception:  # OverflowError (a negative id), TypeError (not an integer), ...
                pass
        self.buffer.frombytes(_read(label, index, name, value, "q", "pass the token ids as a list of ints"))
        self._count(value)

    def _values(self) -> np.ndarray:
        """A view of the buffer, which cannot grow while a view is held."""
        return np.frombuffer(self.buffer, np.int64)

    def truncate(self, count: int) -> None:
        del self.buffer[self.bounds[count] :]
        super().truncate(count)

    def breach(self, first: int = 0, stop: int | None = None) -> tuple[int, Any] | str | None:
        ids = self.values(first, stop).view(np.uint64)  # a negative id reads as 2**63 or more
        if not ids.size:
            return None
        if int(np.minimum.reduce(ids)) <= 1 and (found := self.first_bool(first, ids <= 1)) is not None:
            return found
        return "range" if int(np.maximum.reduce(ids)) >= self.limit else None

    def named(self, breach: str) -> tuple[str, str]:
        position = int(np.flatnonzero(self.values(len(self.lists) - 1).view(np.uint64) >= self.limit)[0])
        token = operator.index(self.lists[-1][position])  # the id as given (a numpy uint64 is not wrapped)
        return (
            f"token id {token} at position {position} is outside {self.span}",
            "the sampler returned an id the trainer's model cannot embed; check both use the same model",
        )


class RealLists(_Lists):
    """Real numbers as float64, each list of a given length, none above ``at_most``; ``remedy`` is
    the field's own fix."""

    not_bool = "values must be real numbers, not bool"

    def __init__(self, at_most: float, remedy: str) -> None:
        super().__init__()
        self.at_most = at_most
        self.remedy = remedy
        self.packed: list[bytes] = []  # one per list
        self.joined: tuple[int, bytes] = (0, b"")  # how many of them, end to end

    def read(self, label: str, index: int | None, name: str, value: Any, length: int) -> None:
        packed = _read(label, index, name, value, "d", f"pass one number per response token; {self.remedy}")
        if len(value) != length:
            problem = f"{len(value)} values for {length} response tokens"
            raise MalformedTrajectoryError(label, index, name, problem, self.remedy)
        self.packed.append(packed)
        self._count(value)

    def _values(self) -> np.ndarray:
        """The packed lists joined once (growing an array by each copies it whenever it moves, and
        copying the join into one costs a fresh allocation's page faults)."""
        if self.joined[0] != len(self.packed):
            self.joined = (len(self.packed), b"".join(self.packed))
        return np.frombuffer(self.joined[1], np.float64)

    def truncate(self, count: int) -> None:
        del self.packed[count:]
        super().truncate(count)

    def breach(self, first: int = 0, stop: int | None = None) -> tuple[int, Any] | str | None:
        values = self.values(first, stop)
        if not values.size:
            return None
        low, high = float(np.minimum.reduce(values)), float(np.maximum.reduce(values))  # NaN -> NaN
        flagged = low <= 1.0 and high >= 0.0  # a bool reads as 0.0 or 1.0
        if flagged and (found := self.first_bool(first, (values == 0.0) | (values == 1.0))) is not None:
            return found
        return _real_trouble(low, high, self.at_most)

    def named(self, breach: str) -> tuple[str, str]:
        values = self.values(len(self.lists) - 1).tolist()
        position = next(i for i, v in enumerate(values) if _real_trouble(v, v, self.at_most) == breach)
        return f"element {position} is {values[position]}{breach}", self.remedy
