"""Record lists: 0-based positions, lookup by label, and ``to_pandas()``."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from backlens.errors import LabelNotFoundError

R = TypeVar("R")


def close_labels(wanted: str, labels: Sequence[str], limit: int = 5) -> list[str]:
    """Labels that look like ``wanted``, best first (prefix matches count too)."""
    close = difflib.get_close_matches(wanted, labels, n=limit, cutoff=0.5)
    if len(close) < limit:
        stem = wanted.rsplit("_", 1)[0]
        for label in labels:
            if label.startswith(stem) and label not in close:
                close.append(label)
                if len(close) == limit:
                    break
    return close


def label_not_found(kind: str, wanted: str, labels: Sequence[str]) -> LabelNotFoundError:
    close = close_labels(wanted, labels)
    hint = f" Close labels: {', '.join(close)}." if close else ""
    return LabelNotFoundError(
        f"No {kind} labelled {wanted!r}.{hint}",
        remedy=f"Use a label from .labels() of the {kind} list.",
    )


class RecordList(Generic[R]):
    """An immutable view over records, indexable by position or label.

    ``label_of`` names the key a record is found by; ``row_of`` turns a record
    into one ``to_pandas()`` row.
    """

    kind = "record"

    def __init__(
        self,
        records: Sequence[R],
        label_of: Callable[[R], str],
        row_of: Callable[[R], dict[str, Any]],
        columns: Sequence[str],
    ):
        self._records = records
        self._label_of = label_of
        self._row_of = row_of
        self._columns = list(columns)
        self._by_label: dict[str, R] | None = None

    def _index(self) -> dict[str, R]:
        if self._by_label is None or len(self._by_label) != len(self._records):
            self._by_label = {self._label_of(r): r for r in self._records}
        return self._by_label

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._records))

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            return key in self._index()
        return any(r is key for r in self._records)

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, str):
            found = self._index().get(key)
            if found is None:
                raise label_not_found(self.kind, key, list(self._index()))
            return found
        if isinstance(key, slice):
            return list(self._records)[key]
        return self._records[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._index().get(key, default)

    def labels(self) -> list[str]:
        return [self._label_of(r) for r in self._records]

    def to_pandas(self):
        """One row per record; columns are stable and documented in docs/records.md."""
        import pandas as pd

        return pd.DataFrame([self._row_of(r) for r in self._records], columns=self._columns)

    def __repr__(self) -> str:
        shown = ", ".join(self.labels()[:6])
        more = ", ..." if len(self) > 6 else ""
        return f"<{len(self)} {self.kind}s: {shown}{more}>"
