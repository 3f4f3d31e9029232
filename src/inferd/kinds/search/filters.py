"""Filters on typed fields: parsing (`parse_filter`) and matching (`FieldColumns`, one column per field).

A filter is a JSON object of conditions AND-ed together, each `{"field": value}` (equals) or
`{"field": {"in": [v1, v2, ...]}}` (equals one of them). Fields and their types are declared per index:
keyword (str), int, float (an int value is accepted), bool. A document without the field, or with a value
of another type, never matches.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from inferd.kinds.search.lexical import grown
from inferd.kinds.search.types import FieldCondition, FieldType, FieldValue, Filter, InvalidFilter

MAX_IN_VALUES = 1024


def _typed(name: str, kind: FieldType, value: object) -> FieldValue:
    """`value` as field `name` holds it, or InvalidFilter."""
    if kind == "keyword" and isinstance(value, str):
        return value
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise InvalidFilter(f"filter field {name!r} is {kind}; got {type(value).__name__} {value!r}")


def _condition(name: str, raw: object, fields: Mapping[str, FieldType]) -> FieldCondition:
    if name not in fields:
        raise InvalidFilter(f"filter names unknown field {name!r}; declared fields: {sorted(fields)}")
    kind = fields[name]
    if isinstance(raw, Mapping):
        if set(raw) != {"in"} or not isinstance(raw["in"], list):
            raise InvalidFilter(f'filter field {name!r}: an object must be {{"in": [values]}}, got {raw!r}')
        values = raw["in"]
        if len(values) > MAX_IN_VALUES:
            raise InvalidFilter(
                f"filter field {name!r}: {len(values)} values in 'in' (at most {MAX_IN_VALUES})"
            )
        return FieldCondition(field=name, values=tuple(_typed(name, kind, v) for v in values))
    if isinstance(raw, list):
        raise InvalidFilter(f'filter field {name!r}: a list must be wrapped as {{"in": [...]}}')
    return FieldCondition(field=name, values=(_typed(name, kind, raw),))


def parse_filter(raw: object, fields: Mapping[str, FieldType]) -> Filter:
    """The parsed filter, or InvalidFilter naming the problem (unknown field, wrong type, bad shape)."""
    if not isinstance(raw, Mapping):
        raise InvalidFilter(f"a filter must be an object of field conditions, got {type(raw).__name__}")
    for name in raw:
        if not isinstance(name, str):
            raise InvalidFilter(f"filter field names must be strings, got {name!r}")
    return Filter(conditions=tuple(_condition(name, value, fields) for name, value in raw.items()))


_MISSING = {"keyword": -1, "int": 0, "float": np.nan, "bool": -1}
_DTYPES = {"keyword": np.int32, "int": np.int64, "float": np.float64, "bool": np.int8}


class FieldColumns:
    """The declared fields' values, one numpy column per field, indexed by slot."""

    def __init__(self, fields: Mapping[str, FieldType]) -> None:
        self.fields = dict(fields)
        self.slots = 0
        self._columns = {name: np.zeros(0, dtype=_DTYPES[kind]) for name, kind in self.fields.items()}
        self._present = {name: np.zeros(0, dtype=bool) for name in self.fields}
        self._codes: dict[str, dict[str, int]] = {n: {} for n, k in self.fields.items() if k == "keyword"}

    def add(self, slot: int, values: Mapping[str, FieldValue]) -> None:
        """Record a document's field values at `slot` (slots come in order)."""
        self.slots = max(self.slots, slot + 1)
        for name, kind in self.fields.items():
            self._columns[name] = grown(self._columns[name], self.slots)
            self._present[name] = grown(self._present[name], self.slots)
            value = values.get(name)
            try:
                stored = self._encode(name, kind, value) if value is not None else None
            except InvalidFilter:
                stored = None  # a value of the wrong type is kept in the document but never matches
            self._present[name][slot] = stored is not None
            self._columns[name][slot] = _MISSING[kind] if stored is None else stored

    def _encode(self, name: str, kind: FieldType, value: object) -> float | int:
        typed = _typed(name, kind, value)
        if kind == "keyword":
            codes = self._codes[name]
            return codes.setdefault(str(typed), len(codes))
        if kind == "bool":
            return int(bool(typed))
        return typed  # type: ignore[return-value]

    def mask(self, filter: Filter) -> np.ndarray:
        """A bool per slot: the document matches every condition."""
        result = np.ones(self.slots, dtype=bool)
        for condition in filter.conditions:
            kind = self.fields[condition.field]
            column = self._columns[condition.field][: self.slots]
            present = self._present[condition.field][: self.slots]
            if kind == "keyword":
                codes = self._codes[condition.field]
                wanted = [codes[v] for v in condition.values if v in codes]  # type: ignore[index]
            elif kind == "bool":
                wanted = [int(bool(v)) for v in condition.values]
            else:
                wanted = list(condition.values)  # type: ignore[arg-type]
            result &= present & np.isin(column, np.asarray(wanted, dtype=column.dtype))
        return result

    def renumber(self, keep: np.ndarray) -> None:
        """Keep only the slots in `keep` (sorted), renumbered 0..len(keep)-1."""
        for name in self.fields:
            self._columns[name] = self._columns[name][keep].copy()
            self._present[name] = self._present[name][keep].copy()
        self.slots = len(keep)
