"""The backward profile of one capture, as rows for rich tables and the HTML report.

Built only from records and reports (cost tree per pass, timeline), so a live
capture and a loaded bundle give the same profile.

Passes (``backlens demo``, ``backlens profile --repeats N``, :func:`run_passes`):
the first is cold (first-touch allocations, lazy initialisation in torch and
backlens) and runs the FLOP census: FLOPs come from it. The warm ones after it
run without the census, so their times are the backward's and backlens's
per-node timing alone; times per module and per node type are medians over
them, with the interquartile range of the pass durations beside. Stock backward
passes of the same model interleaved with them (no backlens) give the
instrumentation overhead measured in the same run. A capture whose passes all
ran the census (a bundle saved by an older backlens, or passes the user ran)
takes its times from them and says that they include the census's cost.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backlens._warn import warn
from backlens.graph.labels import NO_FORWARD_OP, ROOT_NAME
from backlens.report.display import flops_text, seconds_text

NOISY_SPREAD = 0.2  # an interquartile range above this fraction of the median is noise
FEWEST_TO_SPREAD = 3  # fewer timed passes than this (a run asked for): no spread to judge them by


@dataclass
class PassTimes:
    """What :func:`run_passes` measured beside the capture's own records: wall seconds of
    each timed captured pass and of each stock pass interleaved with them, and torch's
    threads against the cores this process may use."""

    captured: list[float] = field(default_factory=list)
    stock: list[float] = field(default_factory=list)
    threads: int | None = None
    cores: int | None = None

    @property
    def overhead(self) -> float | None:
        """Median captured over median stock wall time, minus 1 (None: not measured)."""
        if not self.captured or not self.stock:
            return None
        return statistics.median(self.captured) / statistics.median(self.stock) - 1


@dataclass
class Timing:
    """The backward time a profile reports: over ``passes``, the median and quartiles of
    their durations (seconds); ``census_included``: those passes ran the FLOP census too."""

    passes: list[int]
    median: float | None
    q1: float | None
    q3: float | None
    census_included: bool
    overhead: float | None = None
    stock_passes: int = 0
    threads: int | None = None
    cores: int | None = None
    noisy: list[str] = field(default_factory=list)

    @property
    def iqr(self) -> float | None:
        return self.q3 - self.q1 if self.q1 is not None and self.q3 is not None else None

    @property
    def label(self) -> str:
        """``"median of passes 2-11"``, or ``"pass 1"`` when there is one."""
        timed = self.passes
        if len(timed) > 1:
            return f"median of passes {_numbers(timed)}"
        return f"pass {timed[0]}" if timed else "no pass"

    def text(self) -> str:
        """One sentence: the median, its spread, where it comes from, the overhead."""
        if self.median is None:
            return "backward time: no timed pass"
        spread = f" (interquartile range {seconds_text(self.q1)} to {seconds_text(self.q3)})" \
            if self.iqr is not None else ""
        census = ("; these passes also ran the FLOP census, whose cost their times include"
                  if self.census_included else ", timed without the FLOP census")
        text = f"backward {seconds_text(self.median)}{spread}, {self.label}{census}"
        if self.overhead is not None:
            text += (f"; backlens's timing hooks add {self.overhead:+.0%} against {self.stock_passes} stock "
                     f"backward pass{'es' if self.stock_passes != 1 else ''} of the same model in this run")
        return text


@dataclass
class Profile:
    """Rows of the backward profile; every table is a list of dicts.

    ``cold_pass`` is the first finished pass when there are others after it
    (else None); ``timing.passes`` are the passes the times come from;
    ``tree`` is every module call (whatever ``depth``), ``nodes`` every node,
    for the HTML report's views.
    """

    title: str
    modules: list[dict[str, Any]]
    node_types: list[dict[str, Any]]
    passes: list[dict[str, Any]]
    forward_flops: int | None
    backward_flops: int | None
    backward_state: str
    backward_reason: str | None
    timing: Timing
    depth: int = 3
    cold_pass: int | None = None
    flops_scope: str = "per pass"
    gantt: Any = None
    tree: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)

    @property
    def warm_passes(self) -> list[int]:
        return self.timing.passes

    @property
    def flop_ratio(self) -> float | None:
        if not self.forward_flops or self.backward_flops is None:
            return None
        return self.backward_flops / self.forward_flops

    @property
    def median_pass(self) -> float | None:
        return self.timing.median

    @property
    def cold_pass_duration(self) -> float | None:
        return next((r["duration"] for r in self.passes if r["pass"] == self.cold_pass), None)

    @property
    def warm_label(self) -> str:
        return self.timing.label


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _quartiles(values: list[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return None, None
    q1, _q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _numbers(numbers: list[int]) -> str:
    if len(numbers) > 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(map(str, numbers))


def build_profile(cap: Any, title: str, depth: int = 3, top: int = 10, run: PassTimes | None = None) -> Profile:
    """Profile ``cap``: module rows down to ``depth`` levels, the ``top`` node types;
    ``run``: what :func:`run_passes` measured (the overhead, torch's threads).

    Warns ``timing_noisy`` (a BacklensWarning) when the timed passes' interquartile range
    is over 20% of their median or torch's threads outnumber the cores the process may use.
    """
    from backlens.cost.observer import TIMED_WITHOUT_CENSUS
    from backlens.report.cost_tree import cost_tree

    finished = [p.number for p in cap.passes if p.status == "ok"]
    journal = cap._state.cost
    cost_of = {n: journal.pass_cost(n) if journal is not None else None for n in finished}
    counted = [n for n in finished if (cost_of[n] or {}).get("counted")]
    timed_only = [n for n in finished if (cost_of[n] or {}).get("reason") == TIMED_WITHOUT_CENSUS]
    cold = finished[0] if len(finished) > 1 else None
    timed = timed_only or (finished[1:] if len(finished) > 1 else finished)
    trees = {n: cost_tree(cap, pass_=n) for n in finished}
    reference = trees[counted[0]] if counted else trees[finished[0]] if finished else cost_tree(cap)
    durations = {p.number: p.duration for p in cap.passes}
    timing = _timing(timed, [durations[n] for n in timed if durations[n] is not None],
                     census_included=not timed_only and any(n in counted for n in timed), run=run)

    tree = []
    for row in reference.rows:
        if row.kind != "module":
            continue
        times = [trees[n][row.address] for n in timed]
        tree.append({
            "id": row.address, "name": row.address or ROOT_NAME, "parent": row.parent, "depth": row.depth,
            "type": row.module_type or "",
            "forward_flops": row.subtree_forward_mac_flops,
            "backward_flops": row.subtree_backward_flops,
            "backward_time": _median([t.subtree_backward_time for t in times]),
            "self_time": _median([t.self_backward_time for t in times]),
            "cold_time": trees[cold][row.address].subtree_backward_time if cold is not None else None,
            "calls": row.backward_calls,
        })
    modules = [{**r, "module": "  " * r["depth"] + r["name"]} for r in tree if r["depth"] <= depth]
    for row in reference.rows:
        if row.kind != "module":
            modules.append({
                "module": row.address, "name": row.address, "type": "", "depth": 0, "id": row.address,
                "forward_flops": row.subtree_forward_mac_flops, "backward_flops": row.subtree_backward_flops,
                "backward_time": _median([trees[n][row.address].subtree_backward_time for n in timed]),
                "cold_time": trees[cold][row.address].subtree_backward_time if cold is not None else None,
                "calls": row.backward_calls,
            })

    per_pass: dict[int, dict[str, dict[str, Any]]] = {}
    for number in finished:
        by_type: dict[str, dict[str, Any]] = defaultdict(lambda: {"fires": 0, "time": 0.0, "flops": 0})
        for call in cap.passes.for_pass(number).calls:
            entry = by_type[call.grad_fn.type]
            entry["fires"] += 1
            entry["time"] += call.duration or 0.0
            entry["flops"] = None if entry["flops"] is None or call.flops is None else entry["flops"] + call.flops
        per_pass[number] = by_type
    first = per_pass.get(counted[0] if counted else finished[0], {}) if finished else {}
    node_types = [
        {
            "type": name,
            "fires": entry["fires"],
            "time": _median([per_pass[n][name]["time"] if name in per_pass[n] else None for n in timed]),
            "cold_time": per_pass[cold][name]["time"] if cold is not None and name in per_pass[cold] else None,
            "flops": entry["flops"],
        }
        for name, entry in first.items()
    ]
    node_types = sorted(node_types, key=lambda r: -(r["time"] or 0.0))[:top]

    passes = [
        {
            "pass": p.number,
            "kind": _pass_kind(p.number, cold, counted, timed),
            "trigger": p.trigger,
            "call_site": f"{p.call_site.file.rsplit('/', 1)[-1]}:{p.call_site.line} ({p.call_site.function})"
            if p.call_site else "-",
            "node_calls": len(p.calls),
            "duration": p.duration,
            "status": p.status,
        }
        for p in cap.passes
    ]
    executed = {trees[n].executed_flops for n in counted}
    profile = Profile(
        title=title,
        modules=modules,
        node_types=node_types,
        passes=passes,
        forward_flops=reference.forward_flops,
        backward_flops=reference.executed_flops,
        backward_state=reference.backward_state,
        backward_reason=reference.backward_reason,
        timing=timing,
        depth=depth,
        cold_pass=cold,
        flops_scope=("per pass" if len(executed) <= 1 else f"in pass {counted[0]}")
        + (f", counted in pass {_numbers(counted)}" if counted and counted != finished else ""),
        tree=tree,
        nodes=_node_rows(cap, timed, counted),
    )
    profile.gantt = _gantt(cap, profile, depth, trees)
    if timing.noisy:
        warn("Backward times are noisy: " + "; ".join(timing.noisy) + ". Rerun on a quieter machine, with "
             "more --repeats, or with --threads set to the cores you have.", "timing_noisy")
    return profile


def _pass_kind(number: int, cold: int | None, counted: list[int], timed: list[int]) -> str:
    words = []
    if number == cold:
        words.append("cold")
    if number in counted:
        words.append("FLOPs counted")
    if number in timed and cold is not None:
        words.append("timed")
    return ", ".join(words)


def _timing(timed: list[int], durations: list[float], *, census_included: bool, run: PassTimes | None) -> Timing:
    q1, q3 = _quartiles(durations)
    timing = Timing(timed, statistics.median(durations) if durations else None, q1, q3, census_included)
    if run is not None:
        timing.overhead = run.overhead
        timing.stock_passes = len(run.stock)
        timing.threads, timing.cores = run.threads, run.cores
    if timing.median and timing.iqr is not None and timing.iqr > NOISY_SPREAD * timing.median:
        timing.noisy.append(f"the interquartile range of the timed passes ({seconds_text(timing.iqr)}) is over "
                            f"{NOISY_SPREAD:.0%} of their median ({seconds_text(timing.median)})")
    if run is not None and 0 < len(durations) < FEWEST_TO_SPREAD:
        timing.noisy.append(f"only {len(durations)} timed pass{'es' if len(durations) != 1 else ''}: too few to "
                            f"judge how noisy the times and the overhead are")
    if timing.threads is not None and timing.cores is not None and timing.threads > timing.cores:
        timing.noisy.append(f"torch runs {timing.threads} threads on the {timing.cores} "
                            f"core{'s' if timing.cores != 1 else ''} this process may use")
    return timing


def _node_rows(cap: Any, timed: list[int], counted: list[int]) -> list[dict[str, Any]]:
    """One row per node that fired: its module, op and the op's source line, the median of
    its call times over the timed passes, its FLOPs in the first counted pass."""
    timed_set, first_counted = set(timed), counted[0] if counted else None
    times: dict[str, list[float]] = defaultdict(list)
    flops: dict[str, int | None] = {}
    nodes: dict[str, Any] = {}
    for call in cap.grad_fn_calls:
        node = call.grad_fn
        nodes.setdefault(node.label, node)
        if call.pass_number in timed_set and call.duration is not None:
            times[node.label].append(call.duration)
        if call.pass_number == first_counted:
            flops[node.label] = call.flops
    rows = []
    for label, node in nodes.items():
        op = node.op
        site = op.call_site if op is not None else None
        rows.append({
            "label": label, "type": node.type, "module": node.module_call or "",
            "op": op.label if op is not None else None,
            "source": f"{site.file}:{site.line} ({site.function})" if site is not None else None,
            "time": _median(times.get(label, [])), "flops": flops.get(label),
        })
    return rows


def _representative_pass(trees: dict[int, Any], timed: list[int]) -> tuple[int, str]:
    """The timed pass whose module times are closest to their medians over the timed
    passes (the sum of the absolute log ratios), and a sentence saying so."""
    if len(timed) == 1:
        return timed[0], f"pass {timed[0]}, the one timed pass"
    times = {n: {r.address: r.self_backward_time for r in trees[n].rows if r.kind == "module"} for n in timed}
    medians = {a: _median([times[n].get(a) for n in timed]) for a in times[timed[0]]}

    def distance(number: int) -> float:
        return sum(abs(math.log(t / medians[a])) for a, t in times[number].items()
                   if t and medians.get(a))

    best = min(timed, key=distance)
    return best, (f"pass {best}, of the {len(timed)} timed passes the one whose module times are closest to "
                  "their medians")


def _gantt(cap: Any, profile: Profile, depth: int, trees: dict[int, Any]):
    """The module calls of one representative timed pass on a time axis."""
    from backlens.report.html import Gantt, GanttRow
    from backlens.report.timeline import timeline

    timed = [r["pass"] for r in profile.passes if r["pass"] in profile.timing.passes and r["duration"] is not None]
    if not timed:
        return None
    number, chosen = _representative_pass(trees, timed)
    line = timeline(cap, pass_=number)
    whole = next((s for s in line.for_pass(number) if s.kind == "pass"), None)
    if whole is None:
        return None
    origin = whole.start_ns
    rows = []
    for label, row_depth, pieces in line.module_bars(number, max_depth=depth):
        bars = [((s.start_ns - origin) / 1e6, s.duration_ns / 1e6,
                 f"{s.name}: {seconds_text(s.duration)}" + (f" (stretch {s.args['stretch']})"
                                                           if "stretch" in s.args else ""))
                for s in pieces]
        rows.append(GanttRow(pieces[0].name, row_depth, bars, module=label or ""))
    outside = [s for s in line.for_pass(number) if s.kind == "node" and s.depth == 1]
    if outside:
        rows.append(GanttRow(NO_FORWARD_OP, 0, [((s.start_ns - origin) / 1e6, s.duration_ns / 1e6,
                                                 f"{s.name} ({s.args['type']}): {seconds_text(s.duration)}")
                                                for s in outside], module=NO_FORWARD_OP))
    return Gantt(
        f"Backward timeline of pass {number}: module calls to depth {depth}",
        rows, whole.duration_ns / 1e6, unit="ms",
        note=f"The pass shown: {chosen}. Each bar is a stretch of the backward spent in that module call's "
             "autograd nodes; drag to zoom, double-click to reset, click a row to select its module. "
             "The same slices, with every node call, its ATen calls and the forward, open in Perfetto or "
             "chrome://tracing from bl.report.timeline(cap).save('t.json') or backlens profile --timeline t.json.",
    )


def usable_cores() -> int | None:
    """The cores this process may run on (its CPU affinity), or the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def run_passes(cap: Any, loss: Any, repeats: int, leaves: list[Any],
               stock_loss: Callable[[], Any] | None = None) -> PassTimes:
    """Run the backward of ``loss`` over ``cap`` ``1 + repeats`` times and return what was
    measured: a cold pass with the FLOP census (and the capture's save policy), then
    ``repeats`` warm ones over the retained graph without the census and saving nothing
    (the last one frees it).

    ``stock_loss()``: a loss over a fresh forward of the same model outside any capture;
    when given, a stock backward over it runs before each warm pass (interleaved, so both
    see the same machine) to measure backlens's instrumentation overhead.
    ``.grad`` of ``leaves`` (parameters, inputs) is cleared before each pass so every pass
    does the same work, and holds the last captured pass's gradients at the end.
    """
    import torch

    from backlens._progress import progress
    from backlens.cost.observer import without_census

    measured = PassTimes(threads=torch.get_num_threads(), cores=usable_cores())
    stock = stock_loss() if stock_loss is not None and repeats else None
    total = 1 + repeats + (repeats + 1 if stock is not None else 0)
    with progress("Backward passes", total, unit="passes") as advance:
        _clear(leaves)
        cap.backward(loss, retain_graph=repeats > 0)
        advance(1)
        if stock is not None:  # its first pass is cold too: not measured
            _clear(leaves)
            stock.backward(retain_graph=True)
            advance(1)
        with without_census(cap._state):
            for i in range(repeats):
                last = i == repeats - 1
                if stock is not None:
                    _clear(leaves)
                    began = time.perf_counter()
                    stock.backward(retain_graph=not last)
                    measured.stock.append(time.perf_counter() - began)
                    advance(1)
                _clear(leaves)
                began = time.perf_counter()
                cap.backward(loss, retain_graph=not last, save_grads=False)
                measured.captured.append(time.perf_counter() - began)
                advance(1)
    return measured


def _clear(leaves: list[Any]) -> None:
    for tensor in leaves:
        tensor.grad = None


OWN_CALLS_CAPTION = ("own node calls: calls of autograd nodes made by the module call's own ops, not by its "
                     "submodules' (0 when all its work is in its submodules)")


def rich_tables(profile: Profile) -> list[Any]:
    """The profile as rich renderables (printed by the CLI)."""
    from rich.table import Table as RichTable

    cold = profile.cold_pass
    timing = f"time: {profile.warm_label}" + (f", pass {cold} cold apart" if cold is not None else "")
    modules = RichTable(title=f"Backward profile per module to depth {profile.depth} (subtree totals; {timing}; "
                              f"FLOPs {profile.flops_scope})", caption=OWN_CALLS_CAPTION)
    columns = ["module", "type", "fwd FLOPs", "bwd FLOPs", "bwd time"] + (["cold"] if cold else [])
    for column in [*columns, "own node calls"]:
        modules.add_column(column, justify="left" if column in ("module", "type") else "right",
                           overflow="fold")
    for row in profile.modules:
        cells = [row["module"], row["type"], flops_text(row["forward_flops"]), flops_text(row["backward_flops"]),
                 seconds_text(row["backward_time"])]
        if cold:
            cells.append(seconds_text(row["cold_time"]))
        modules.add_row(*cells, str(row["calls"]))

    types = RichTable(title=f"The {len(profile.node_types)} costliest node types (by backward time; {timing})")
    for column in ["node type", "fires", "time"] + (["cold"] if cold else []) + ["FLOPs"]:
        types.add_column(column, justify="left" if column == "node type" else "right", overflow="fold")
    for row in profile.node_types:
        cells = [row["type"], str(row["fires"]), seconds_text(row["time"])]
        if cold:
            cells.append(seconds_text(row["cold_time"]))
        types.add_row(*cells, flops_text(row["flops"]))

    passes = RichTable(title="Backward passes")
    for column in ("pass", "", "trigger", "call site", "node calls", "duration", "status"):
        passes.add_column(column, overflow="fold")
    for row in profile.passes:
        passes.add_row(str(row["pass"]), row["kind"], row["trigger"], row["call_site"], str(row["node_calls"]),
                       seconds_text(row["duration"]), row["status"])
    return [modules, types, passes]


def summary_line(profile: Profile) -> str:
    ratio = profile.flop_ratio
    ratio_text = f"{ratio:.2f}x" if ratio is not None else f"unknown ({profile.backward_reason})"
    text = (f"forward {flops_text(profile.forward_flops)} FLOPs, backward {flops_text(profile.backward_flops)} "
            f"FLOPs executed {profile.flops_scope}; backward/forward FLOP ratio {ratio_text}; "
            + profile.timing.text())
    if profile.cold_pass is not None:
        text += f"; cold first pass {seconds_text(profile.cold_pass_duration)}"
    if profile.timing.noisy:
        text += "; NOISY: " + "; ".join(profile.timing.noisy)
    return text


def html_report(profile: Profile, subtitle: str = "") -> Any:
    """The profile as a self-contained HTML report (see report/html.py)."""
    from backlens.report.profile_page import profile_page

    return profile_page(profile, subtitle)
