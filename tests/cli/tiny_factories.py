"""Factories the CLI tests point `backlens profile` at."""

import torch.nn as nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class NeedsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, mask):
        return self.fc(x) * mask


def build():
    return Tiny()


def build_needs_mask():
    return NeedsMask()


def build_broken():
    raise RuntimeError("weights file missing")


def build_not_a_model():
    return 42
