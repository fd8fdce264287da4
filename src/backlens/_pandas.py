"""Tables for ``to_pandas()``: one rule for missing values across pandas versions.

pandas 3 infers its ``str`` dtype for a column of strings, which turns a missing
string into ``nan``. backlens says "unknown" with ``None`` (and ``0`` for zero),
so a column holding text keeps Python objects and its missing values stay
``None``, under pandas 2 and 3 alike. Numeric columns are left to pandas.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def data_frame(rows: Iterable[Sequence[Any] | dict[str, Any]], columns: Sequence[str]):
    """A DataFrame of ``rows`` (dicts or sequences) with ``columns`` in that order."""
    import pandas as pd

    rows = list(rows)
    names = list(columns)
    if rows and isinstance(rows[0], dict):
        values = {name: [row.get(name) for row in rows] for name in names}
    else:
        values = {name: [row[i] for row in rows] for i, name in enumerate(names)}
    data = {}
    for name, column in values.items():
        texty = any(isinstance(v, str) for v in column)
        data[name] = pd.Series(column, dtype=object) if texty else column
    return pd.DataFrame(data, columns=names)
