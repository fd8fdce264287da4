"""Small test models and their inputs, built from configs with random weights."""

from __future__ import annotations

import torch
import torch.nn as nn


class BackwardExplodes(torch.autograd.Function):
    """Doubles in the forward; its backward raises (a pass that fails inside a node)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward exploded")


class Double(torch.autograd.Function):
    """A custom Function: doubles in the forward and in the backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Sleepy(torch.autograd.Function):
    """The identity, whose backward sleeps 0 to 30 ms at random: a noisy machine."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import random
        import time

        time.sleep(random.uniform(0.0, 0.03))
        return grad


class MLP(nn.Module):
    def __init__(self, sizes=(6, 16, 16, 3)):
        super().__init__()
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(self.pool(x).flatten(1))


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(n_layer: int = 2):
    t = _quiet_transformers()
    cfg = t.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                       bos_token_id=0, eos_token_id=0)
    return t.GPT2LMHeadModel(cfg).eval()


def bert():
    t = _quiet_transformers()
    cfg = t.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, vocab_size=64, max_position_embeddings=32)
    return t.BertModel(cfg).eval()


def llama():
    t = _quiet_transformers()
    cfg = t.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                        max_position_embeddings=32)
    return t.LlamaForCausalLM(cfg).eval()


def t5():
    t = _quiet_transformers()
    cfg = t.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, vocab_size=64,
                     decoder_start_token_id=0)
    return t.T5ForConditionalGeneration(cfg).eval()


def token_ids(batch: int = 2, seq: int = 8, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator)


def first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return output[0]


# name -> (factory, inputs factory returning (args, kwargs))
CASES = {
    "mlp": (lambda: MLP(), lambda: ((torch.randn(4, 6, generator=torch.Generator().manual_seed(1)),), {})),
    "cnn": (lambda: SmallCNN().eval(),
            lambda: ((torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2)),), {})),
    "gpt2": (gpt2, lambda: ((token_ids(),), {})),
    "gpt2_cache": (gpt2, lambda: ((token_ids(),), {"use_cache": True})),
    "bert": (bert, lambda: ((token_ids(),), {})),
    "llama": (llama, lambda: ((token_ids(),), {})),
    "t5": (t5, lambda: ((token_ids(),), {"decoder_input_ids": token_ids(seq=5, seed=3)})),
}


def build(name: str, seed: int = 0):
    factory, make_inputs = CASES[name]
    torch.manual_seed(seed)
    model = factory()
    args, kwargs = make_inputs()
    return model, args, kwargs


def loss_of(output) -> torch.Tensor:
    out = first_tensor(output)
    return (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum()
