"""Records and record lists: 0-based positions, lookup by label, and ``to_pandas()``.

A record is a view of one entry of a capture state (capture/views.py) with the
public surface added: gradients, the records it relates to, a table row.
``FIELDS`` names a record type's public fields, ``COLUMNS`` its table's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from backlens._pandas import data_frame
from backlens.capture.views import View
from backlens.errors import LabelNotFoundError, UnsupportedInputError
from backlens.graph.labels import label_not_found

R = TypeVar("R", bound="Record")

# kind -> record class: what a record reads a related entry as (View.VIEWS).
RECORDS: dict[str, type[View]] = {}


class Record(View):
    """A view with the public surface; every subclass registers under its ``kind``."""

    __slots__ = ()
    VIEWS = RECORDS
    noun: ClassVar[str]  # what a list of them calls one in messages
    FIELDS: ClassVar[tuple[str, ...]]
    COLUMNS: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        RECORDS[cls.kind] = cls

    @staticmethod
    def key_of(state: Any, at: int) -> str:
        """The label a list finds entry ``at`` by (read from the entry, no record built)."""
        raise NotImplementedError

    def row(self) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS[:3])
        return f"{type(self).__name__}({shown})"


class RecordList(Generic[R]):
    """An immutable view over records of one type, indexable by position or label."""

    def __init__(self, state: Any, cls: type[R], positions: Sequence[int]):
        self._state = state
        self._cls = cls
        self._positions = positions
        self._by_label: dict[str, int] | None = None

    @property
    def kind(self) -> str:
        return self._cls.noun

    def _record(self, position: int) -> R:
        return self._state.view(self._cls, position)

    def _index(self) -> dict[str, int]:
        if self._by_label is None:
            key_of, state = self._cls.key_of, self._state
            self._by_label = {key_of(state, p): p for p in self._positions}
        return self._by_label

    def __len__(self) -> int:
        return len(self._positions)

    def __iter__(self) -> Iterator[R]:
        return iter([self._record(p) for p in self._positions])

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            return key in self._index()
        return any(r is key for r in self)

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, str):
            found = self._index().get(key)
            if found is None:
                raise label_not_found(self.kind, key, list(self._index()))
            return self._record(found)
        if isinstance(key, slice):
            return [self._record(p) for p in self._positions[key]]
        if isinstance(key, bool) or not isinstance(key, int):
            raise UnsupportedInputError(
                f"Records ({self.kind} list) are indexed by position (int), label (str) or slice, not "
                f"{type(key).__name__} ({key!r}).", code="bad_index",
                remedy="Use a position such as [0], a label from .labels(), or a slice.")
        if not -len(self._positions) <= key < len(self._positions):
            raise LabelNotFoundError(
                f"No {self.kind} at position {key}: there are {len(self._positions)} "
                f"(positions 0..{len(self._positions) - 1}).", code="index_out_of_range",
                remedy=f"Use a position below {len(self._positions)}, or look up by label.")
        return self._record(self._positions[key])

    def get(self, key: str, default: Any = None) -> Any:
        if not isinstance(key, str):
            return default
        found = self._index().get(key)
        return default if found is None else self._record(found)

    def labels(self) -> list[str]:
        return list(self._index())

    def to_pandas(self):
        """One row per record; columns are stable and documented in docs/records.md."""
        return data_frame([r.row() for r in self], self._cls.COLUMNS)

    def __repr__(self) -> str:
        shown = ", ".join(self.labels()[:6])
        more = ", ..." if len(self) > 6 else ""
        return f"<{len(self)} {self.kind}s: {shown}{more}>"
