"""Fixtures for the live-tracing tests (helpers live in live_helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from live_helpers import MLP  # noqa: E402

import backlens.live as bl  # noqa: E402  (the environment above must come first)


@pytest.fixture
def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


@pytest.fixture
def lens(mlp: MLP) -> bl.Lens:
    return bl.wrap(mlp)


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(5, 4)
