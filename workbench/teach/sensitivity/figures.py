"""Lab 15's computations and figures: the layer scan, plan bytes, budget plans, the Pareto front."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from torch import nn

from workbench.analysis.search import KEEP, solve
from workbench.analysis.sweep import pareto
from workbench.measurement.footprint import size_bytes
from workbench.plans.apply import apply
from workbench.plans.plan import Plan
from workbench.plots.style import TEMPLATE

__all__ = ["KEEP", "candidates", "layer_table", "evaluate", "options", "plan_bytes", "predicted", "to_plan",
           "measure_plan", "loss_figure", "budget_plans", "allocation_table", "pareto_figure"]


_COLOURS = {"int8": "#1f77b4", "int4": "#ff7f0e", "int3": "#9467bd", "int2": "#d62728", KEEP: "#7f7f7f"}


def candidates(bits: Sequence[int] = (8, 4, 2)) -> dict:
    """``{"int<b>": WeightOnly(bits=b, per output channel)}``: symmetric round-to-nearest weights with one fp16
    scale per output channel, on the reference kernel (the same numbers on any machine)."""
    from workbench.quantization.configs import WeightOnly

    return {f"int{b}": WeightOnly(bits=b, group_size=None, kernel="reference") for b in bits}


def layer_table(model: nn.Module, layers: Sequence[str]):
    """The layers' type, weight shape, parameters and bytes (fp32, bias included)."""
    import pandas as pd

    rows = []
    for name in layers:
        m = model.get_submodule(name)
        rows.append({"layer": name, "type": type(m).__name__, "weight": tuple(m.weight.shape),
                     "parameters": sum(p.numel() for p in m.parameters()), "bytes": size_bytes(m)})
    return pd.DataFrame(rows)


def evaluate(model: nn.Module, task) -> float:
    """The task's primary metric on its whole test split."""
    return float(task.evaluate(model)[task.primary.name])


def options(table) -> dict[str, list[tuple[str, float, int]]]:
    """``{layer: [(option, loss, bytes), ...]}`` from a `wb.sensitivity` table, ``"keep"`` (loss 0, the fp32
    bytes) first and the candidates by decreasing bytes: the knapsack's input."""
    out: dict[str, list[tuple[str, float, int]]] = {}
    for layer, rows in table[table["status"] == "ok"].groupby("layer", sort=False):
        opts = [(KEEP, 0.0, int(rows["size_before"].iloc[0]))]
        opts += sorted(((r.candidate, float(r.loss), int(r.size_after)) for r in rows.itertuples()),
                       key=lambda o: -o[2])
        out[layer] = opts
    return out


def _lookup(opts: Mapping[str, Sequence[tuple[str, float, int]]], plan: Mapping[str, str]) -> list[tuple]:
    missing = [layer for layer in opts if layer not in plan]
    if missing:
        raise ValueError(f"the plan gives no option for layer(s) {missing}")
    out = []
    for layer, choice in plan.items():
        hit = [o for o in opts[layer] if o[0] == choice] if layer in opts else []
        if not hit:
            raise ValueError(f"layer {layer!r} has no option {choice!r}")
        out.append(hit[0])
    return out


def plan_bytes(opts, plan: Mapping[str, str]) -> int:
    """Total bytes of the searched layers under ``plan`` ``{layer: option}``, from the options' measured bytes."""
    return sum(o[2] for o in _lookup(opts, plan))


def predicted(opts, plan: Mapping[str, str], base: float) -> float:
    """The additive prediction: ``base`` minus the single-layer losses of the plan's choices."""
    return base - sum(o[1] for o in _lookup(opts, plan))


def to_plan(plan: Mapping[str, str], configs: Mapping) -> Plan:
    """A `wb.Plan` from ``{layer: option}`` (``"keep"`` layers left out)."""
    return Plan([(layer, configs[choice]) for layer, choice in plan.items() if choice != KEEP])


def measure_plan(model: nn.Module, task, plan: Mapping[str, str], configs: Mapping) -> tuple[float, int]:
    """Apply ``plan`` (`wb.apply`; ``model`` is not changed) and measure: (metric on the test split, the
    searched layers' real bytes)."""
    compressed = apply(model, to_plan(plan, configs), progress=False) if any(c != KEEP for c in plan.values()) \
        else model
    return evaluate(compressed, task), int(sum(size_bytes(compressed.get_submodule(n)) for n in plan))


def loss_figure(table, layers_table=None):
    """Heatmap of the single-layer loss (layer x candidate), with each layer's fp32 bytes in its label."""
    import plotly.graph_objects as go

    pivot = table.pivot(index="layer", columns="candidate", values="loss")
    order = list(dict.fromkeys(table["layer"]))
    cols = list(dict.fromkeys(table["candidate"]))
    pivot = pivot.loc[order, cols]
    labels = order
    if layers_table is not None:
        kb = dict(zip(layers_table["layer"], layers_table["bytes"], strict=True))
        labels = [f"{n} ({kb[n] / 1024:.0f} KiB)" for n in order]
    fig = go.Figure(go.Heatmap(z=pivot.values.tolist(), x=cols, y=labels, colorscale="Reds",
                               text=[[f"{v:+.3f}" for v in row] for row in pivot.values.tolist()],
                               texttemplate="%{text}", colorbar=dict(title="loss")))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title="Accuracy lost when only that layer is quantized", xaxis_title="candidate",
                      template=TEMPLATE, height=380)
    return fig


def budget_plans(model: nn.Module, task, table, configs: Mapping, base: float, fractions: Sequence[float]):
    """For each budget (a fraction of the searched layers' fp32 bytes), the exact knapsack plan
    (`wb.analysis.solve`), and every uniform plan: predicted and measured metric, bytes. Columns: plan, kind,
    budget_fraction, size_bytes, predicted, measured, choice."""
    import pandas as pd

    opts = options(table)
    total = sum(o[0][2] for o in opts.values())
    rows, seen = [], {}
    for label in configs:
        choice = {layer: label for layer in opts}
        seen[tuple(choice.values())] = f"uniform {label}"
        acc, nbytes = measure_plan(model, task, choice, configs)
        rows.append({"plan": f"uniform {label}", "kind": "uniform", "budget_fraction": math.nan,
                     "size_bytes": nbytes, "predicted": predicted(opts, choice, base), "measured": acc,
                     "choice": dict(choice)})
    for f in fractions:
        choice = solve(opts, f * total)
        key = tuple(choice[layer] for layer in opts)
        if key in seen:
            continue
        seen[key] = f"searched {f:.0%}"
        acc, nbytes = measure_plan(model, task, choice, configs)
        rows.append({"plan": f"searched {f:.0%}", "kind": "searched", "budget_fraction": f, "size_bytes": nbytes,
                     "predicted": predicted(opts, choice, base), "measured": acc, "choice": dict(choice)})
    return pd.DataFrame(rows)


def allocation_table(opts, fractions: Sequence[float]):
    """Greedy against exact (`wb.analysis.solve`) at each budget (a fraction of the fp32 bytes): predicted
    total loss and bytes of each. Columns: budget_fraction, budget_bytes, greedy_loss, greedy_bytes,
    exact_loss, exact_bytes."""
    import pandas as pd

    total = sum(o[0][2] for o in opts.values())
    rows = []
    for f in fractions:
        (gl, gb), (el, eb) = _totals(opts, _greedy_reference(opts, f * total)), _totals(opts, solve(opts, f * total))
        rows.append({"budget_fraction": f, "budget_bytes": round(f * total), "greedy_loss": gl, "greedy_bytes": gb,
                     "exact_loss": el, "exact_bytes": eb})
    return pd.DataFrame(rows)


def pareto_figure(plans, base: float, fp32_bytes: int, metric: str = "accuracy"):
    """Measured metric against bytes for uniform and searched plans, the predictions as hollow markers joined
    to their measurement, and the measured Pareto front."""
    import plotly.graph_objects as go

    fig = go.Figure()
    front = plans[pareto(plans, "size_bytes", "measured", y_higher_is_better=True)].sort_values("size_bytes")
    fig.add_trace(go.Scatter(x=list(front["size_bytes"]), y=list(front["measured"]), mode="lines",
                             name="measured Pareto front", line=dict(color="#2ca02c", width=2, dash="dot")))
    for kind, colour, symbol in (("uniform", "#1f77b4", "square"), ("searched", "#d62728", "circle")):
        part = plans[plans["kind"] == kind]
        for _, r in part.iterrows():
            fig.add_trace(go.Scatter(x=[r["size_bytes"]] * 2, y=[r["predicted"], r["measured"]], mode="lines",
                                     line=dict(color=colour, width=1), showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=list(part["size_bytes"]), y=list(part["measured"]), mode="markers+text",
                                 name=f"{kind} (measured)", text=list(part["plan"]), textposition="top center",
                                 marker=dict(size=11, color=colour, symbol=symbol)))
        fig.add_trace(go.Scatter(x=list(part["size_bytes"]), y=list(part["predicted"]), mode="markers",
                                 name=f"{kind} (predicted)", marker=dict(size=9, color=colour, symbol=symbol,
                                                                         line=dict(color=colour, width=2)),
                                 opacity=0.5))
    fig.add_hline(y=base, line=dict(color="#7f7f7f", dash="dash"), annotation_text=f"fp32 ({fp32_bytes:,} bytes)")
    fig.update_xaxes(type="log", title="bytes of the quantized layers (log scale; lower is better)")
    fig.update_yaxes(title=f"{metric} on the test split (higher is better)")
    fig.update_layout(title="Mixed bit-widths against uniform ones: measured (filled) and predicted (faded)",
                      template=TEMPLATE, height=480)
    return fig


# --- greedy allocation and plan totals (`allocation_table`'s, and the exercise checks' reference) ---------

def _greedy_reference(opts, limit: float) -> dict[str, str]:
    """The greedy bit assignment (the checker's own implementation): from every layer at its first (largest)
    option, repeatedly take the one-step downgrade with the smallest added loss per byte saved (ties: the
    earlier layer) until the plan fits ``limit``."""
    level = dict.fromkeys(opts, 0)

    def cost() -> int:
        return sum(opts[layer][i][2] for layer, i in level.items())

    while cost() > limit:
        moves = []
        for order, (layer, i) in enumerate(level.items()):
            if i + 1 < len(opts[layer]):
                (_, l0, b0), (_, l1, b1) = opts[layer][i], opts[layer][i + 1]
                moves.append(((l1 - l0) / (b0 - b1), order, layer))
        if not moves:
            raise ValueError(f"no plan fits {limit:,.0f} bytes")
        level[min(moves)[2]] += 1
    return {layer: opts[layer][i][0] for layer, i in level.items()}


def _totals(opts, plan) -> tuple[float, int] | None:
    try:
        found = _lookup(opts, plan)
    except (ValueError, TypeError, AttributeError):
        return None
    return (round(sum(o[1] for o in found), 9), sum(o[2] for o in found))
