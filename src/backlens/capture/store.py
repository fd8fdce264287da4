"""Where saved gradients live: in memory by default, on disk with ``bl.to_disk``.

Call entries hold whatever ``keep`` returns (a handle), and records read the
tensors back through ``load``. A store may write as tensors arrive and read
them back lazily; a loaded bundle's store (io/bundle.py) only reads.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TensorStore(Protocol):
    def keep(self, tensors: tuple[torch.Tensor | None, ...], name: str) -> Any:
        """Take ownership of ``tensors`` (one node call's side) and return a handle."""

    def load(self, handle: Any) -> tuple[torch.Tensor | None, ...]:
        """The tensors behind a handle ``keep`` returned."""

    def close(self) -> None:
        """Flush and release whatever the store holds open."""


class MemoryStore:
    """Keeps references to the tensors autograd produced (no copies)."""

    def keep(self, tensors: tuple[torch.Tensor | None, ...], name: str) -> tuple:
        return tensors

    def load(self, handle: tuple) -> tuple:
        return handle

    def close(self) -> None:
        return None
