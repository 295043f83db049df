"""`search`: choose one candidate per layer to lose the least quality within a size or latency budget.

The per-layer measurements of `sensitivity` define a multiple-choice knapsack: layer ``l`` takes exactly
one option ``c`` (a candidate config, or - with ``keep=True`` - the layer as it is), costing ``cost[l, c]``
(the layer's real bytes, or its measured latency) and predicted to lose ``loss[l, c]`` of the metric.
Minimise ``sum(loss)`` subject to ``sum(cost) <= budget``: solved exactly as a 0/1 integer program with
`scipy.optimize.milp` (HiGHS); among equally good solutions the cheapest is taken. Losses are assumed to
add up, which is only a prediction - so the chosen plan is then applied and measured, and the report puts
predicted and measured quality (and cost) side by side.

Verification measures on the evaluation the user reads (the task's full test set, ``verify="full"``, the
default), or on the quick subset, or on both side by side. Each measured quality carries its 95 % sampling
error (`workbench.measurement.sampling`); two plans whose difference lies inside the combined error *tie*,
and the cheapest plan that no other plan beats beyond the error is the one returned and recommended.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from torch import nn

from workbench.analysis import candidates as cands_mod
from workbench.plans.plan import Plan
from workbench.plans.registry import Config, config_from_dict
from workbench.tasks.base import Task, check_model

__all__ = ["Budget", "SearchReport", "search", "solve", "uniform_plans"]

RESOURCES = {"size_bytes": ("size_before", "size_after", "bytes"),
             "latency_ms": ("latency_before_ms", "latency_after_ms", "ms")}
KEEP = "keep"
VERIFY = ("full", "quick", "both")   # which evaluation(s) `search` verifies on; "full" decides wherever measured
EVALUATION = {"full": "the full evaluation", "quick": "the quick subset"}


@dataclass(frozen=True)
class Budget:
    """A limit on the total ``resource`` ("size_bytes" or "latency_ms") of the searched layers;
    ``relative=True`` makes ``limit`` a fraction of their current total."""

    limit: float
    resource: str = "size_bytes"
    relative: bool = False

    def __post_init__(self):
        if self.resource not in RESOURCES:
            raise ValueError(f"Budget.resource must be one of {sorted(RESOURCES)}, got {self.resource!r}")
        if not isinstance(self.limit, (int, float)) or isinstance(self.limit, bool) or not self.limit > 0:
            raise ValueError(f"Budget.limit must be a positive number, got {self.limit!r}")
        if self.relative and self.limit > 1:
            raise ValueError(f"a relative Budget.limit is a fraction in (0, 1], got {self.limit}")

    @classmethod
    def size(cls, nbytes: int) -> "Budget":
        return cls(nbytes, "size_bytes")

    @classmethod
    def size_fraction(cls, fraction: float) -> "Budget":
        return cls(fraction, "size_bytes", relative=True)

    @classmethod
    def latency(cls, ms: float) -> "Budget":
        return cls(ms, "latency_ms")

    @classmethod
    def latency_fraction(cls, fraction: float) -> "Budget":
        return cls(fraction, "latency_ms", relative=True)

    def __str__(self) -> str:
        unit = RESOURCES[self.resource][2]
        return f"{self.limit:.0%} of current {unit}" if self.relative else f"{self.limit:,.6g} {unit}"


def _options(table, resource: str, keep: bool) -> dict[str, list[tuple[str, float, float]]]:
    """layer -> [(option, loss, cost), ...] from a sensitivity table."""
    before, after, _ = RESOURCES[resource]
    missing = [c for c in ("layer", "candidate", "status", "loss", before, after) if c not in table.columns]
    if missing:
        raise ValueError(f"the sensitivity table lacks column(s) {missing}; compute it with wb.sensitivity"
                         f"{'(..., latency=True)' if resource == 'latency_ms' else ''}")
    out: dict[str, list[tuple[str, float, float]]] = {}
    for layer, rows in table.groupby("layer", sort=False):
        opts: list[tuple[str, float, float]] = []
        if keep:
            opts.append((KEEP, 0.0, float(rows[before].iloc[0])))
        for _, r in rows[rows["status"] == "ok"].iterrows():
            opts.append((r["candidate"], float(r["loss"]), float(r[after])))
        bad = [o for o in opts if not np.isfinite(o[1]) or not np.isfinite(o[2])]
        if bad:
            raise ValueError(f"layer {layer!r}: option(s) {[o[0] for o in bad]} have no measured {resource}; "
                             f"compute the table with latency=True for a latency budget")
        if not opts:
            raise ValueError(f"layer {layer!r} has no usable candidate (statuses: {sorted(set(rows['status']))}); "
                             f"allow keep=True or drop the layer")
        out[layer] = opts
    if not out:
        raise ValueError("the sensitivity table is empty")
    return out


def solve(options: Mapping[str, Sequence[tuple[str, float, float]]], limit: float) -> dict[str, str]:
    """Exact multiple-choice knapsack: ``{layer: option}`` minimising total loss with total cost <= limit
    (ties broken towards lower cost). ``options``: layer -> [(option, loss, cost), ...]."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    layers = list(options)
    flat = [(layer, name, loss, cost) for layer in layers for name, loss, cost in options[layer]]
    n = len(flat)
    loss = np.array([f[2] for f in flat])
    cost = np.array([f[3] for f in flat])
    minimum = sum(min(c for _, _, c in options[layer]) for layer in layers)
    if minimum > limit * (1 + 1e-12):
        raise ValueError(f"budget {limit:,.6g} is below the smallest achievable total {minimum:,.6g} "
                         f"(every layer at its cheapest option)")
    member = np.zeros((len(layers), n))
    for j, f in enumerate(flat):
        member[layers.index(f[0]), j] = 1
    one_each = LinearConstraint(member, 1, 1)
    scale = max(1.0, float(np.abs(cost).max()))
    within = LinearConstraint(cost[None, :] / scale, -np.inf, limit / scale)
    common = dict(integrality=np.ones(n), bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0})
    first = milp(loss, constraints=[one_each, within], **common)
    if not first.success:
        raise RuntimeError(f"the knapsack solver failed: {first.message}")
    best = float(loss @ np.round(first.x))
    tol = 1e-9 * max(1.0, float(np.abs(loss).sum()))
    second = milp(cost / scale, constraints=[one_each, within, LinearConstraint(loss[None, :], -np.inf, best + tol)],
                  **common)
    x = np.round(second.x if second.success else first.x)
    return {flat[j][0]: flat[j][1] for j in range(n) if x[j] > 0.5}


def uniform_plans(table) -> dict[str, Plan]:
    """``{candidate: Plan}`` applying each candidate to every layer of ``table`` that it supports."""
    out = {}
    for lbl, rows in table[table["status"] == "ok"].groupby("candidate", sort=False):
        config = config_from_dict(json.loads(rows["config"].iloc[0]), f"candidate {lbl!r}")
        out[lbl] = Plan({layer: config for layer in rows["layer"]})
    return out


@dataclass
class SearchReport:
    """What `search` chose, what it predicted and what was measured.

    ``measured_quality`` comes with ``measured_error``, the 95 % half-width of its sampling error (nan where the
    task states none), measured on ``evaluation`` ("full": the task's full test set, "quick": its quick subset;
    "" when not verified). ``verified`` has one row per measured plan; ``recommendation`` says which plan is
    returned and why: differences inside the sampling error are ties, and the cheapest tied plan wins."""

    budget: Budget
    limit: float
    minimum: float
    current: float
    metric: str
    higher_is_better: bool
    base_quality: float
    predicted_quality: float
    predicted_cost: float
    choices: Any                     # DataFrame: layer, option, loss, cost
    measured: Any = None             # Metrics of the applied plan (verify=True) on `evaluation`
    measured_quality: float = float("nan")
    measured_cost: float = float("nan")
    notes: list[str] = field(default_factory=list)
    verified: Any = None             # DataFrame: each plan measured, predicted vs measured, which was chosen
    measured_error: float = float("nan")   # 95 % half-width of measured_quality's sampling error
    evaluation: str = ""             # "full" or "quick": what `measured` was measured on ("" = not verified)
    measured_quick: Any = None       # Metrics on the quick subset, beside the full ones (verify="both")
    recommendation: str = ""         # which plan is returned, and why (ties, cost)
    base_quick: bool | None = None   # whether base/predicted quality come from the quick subset (None: unknown)

    def summary(self):
        """Predicted vs measured quality and cost, one row each (``± (95 %)``: the sampling error)."""
        import pandas as pd

        unit = RESOURCES[self.budget.resource][2]
        return pd.DataFrame(
            {self.metric: [self.base_quality, self.predicted_quality, self.measured_quality],
             f"{self.metric} ± (95 %)": [float("nan"), float("nan"), self.measured_error],
             f"cost ({unit})": [self.current, self.predicted_cost, self.measured_cost],
             f"budget ({unit})": [self.limit] * 3},
            index=["reference", "predicted", "measured"])

    def __str__(self) -> str:
        unit = RESOURCES[self.budget.resource][2]
        counts = self.choices["option"].value_counts().to_dict()
        source = ("" if self.base_quick is None else
                  f" ({EVALUATION['quick' if self.base_quick else 'full']}, as the sensitivity)")
        if self.evaluation:
            measured = (f"measured {_pm(self.measured_quality, self.measured_error)} "
                        f"({EVALUATION[self.evaluation]})")
        else:
            measured = "not measured (verify=False)"
        lines = [f"search under {self.budget} = {self.limit:,.6g} {unit} (minimum {self.minimum:,.6g}, "
                 f"now {self.current:,.6g}): {counts}",
                 f"{self.metric}: reference {self.base_quality:.4f}, predicted {self.predicted_quality:.4f}"
                 f"{source}, {measured}",
                 f"{unit}: predicted {self.predicted_cost:,.6g}, measured {self.measured_cost:,.6g}"]
        v = self.verified
        if self.evaluation and v is not None and len(v):
            lines.append(f"plans measured on {EVALUATION[self.evaluation]} ({self.metric} ± 95 % sampling error):")
            width = max(len(str(p)) for p in v["plan"])
            for _, row in v.iterrows():
                quick = (f"   quick subset {_pm(row['measured_quick'], row['measured_quick_error'])}"
                         if "measured_quick" in v.columns else "")
                cost = row["measured_cost"] if self.budget.resource == "size_bytes" else row["predicted_cost"]
                mark = "   <- recommended" if row["chosen"] else ("" if row["fits"] else "   (over the budget)")
                lines.append(f"  {str(row['plan']):<{width}}  {_pm(row['measured'], row['measured_error'])}"
                             f"{quick}   {cost:,.6g} {unit}{mark}")
        if self.recommendation:
            lines.append(self.recommendation)
        return "\n".join(lines + self.notes)


def _pm(value: float, error: float | None) -> str:
    """"0.9722 ± 0.014", or the bare value where the sampling error is unknown."""
    if error is None or not np.isfinite(error):
        return f"{value:.4f}"
    return f"{value:.4f} ± {_err(error)}"


def _err(error: float) -> str:
    """Two significant figures, trailing zeros kept: 0.010, 0.014, 12."""
    return f"{error:#.2g}".rstrip(".")


def _searched_cost(model: nn.Module, task: Task, layers: Sequence[str], resource: str, batch_size=None) -> float:
    """The real total bytes, or measured own latency, of ``layers`` in ``model``."""
    from workbench.analysis.sensitivity import layer_latencies
    from workbench.measurement.footprint import size_bytes

    if resource == "size_bytes":
        return float(sum(size_bytes(model.get_submodule(n)) for n in layers))
    return float(sum(layer_latencies(model, task, layers, batch_size).values()))


def search(model: nn.Module, task: Task | str, candidates: Sequence[Config] | Mapping[str, Config],
           budget: Budget | int, *, table=None, layers=None, keep: bool = True, verify: bool | str = True,
           calibration: int | Sequence | None = 32, quick: bool = True, progress: bool = True, n_verify: int = 3,
           **sensitivity_options) -> tuple[Plan, SearchReport]:
    """The plan (one candidate, or no change, per layer) that minimises the predicted quality loss within
    ``budget`` (a `Budget`, or an int = bytes), and a `SearchReport` with predicted vs measured results.

    ``table``: a `sensitivity` table to reuse (otherwise it is measured, with ``quick`` and
    ``sensitivity_options``). ``keep``: whether leaving a layer unchanged is an option.
    ``verify``: apply and measure the knapsack's plan, up to ``n_verify - 1`` knapsack plans under slightly
    tighter limits, and every uniform candidate that fits the budget (as AIMET's AMP does), on
    ``"full"`` (True, the default: the task's full evaluation, the numbers a user reads), ``"quick"`` (the quick
    subset: faster, noisier) or ``"both"`` (side by side; the full evaluation decides); False: no verification.
    Each measured quality carries its 95 % sampling error. The plan returned is the cheapest of those that fit
    and that no other plan that fits beats beyond the sampling error: a difference inside it is a tie, and
    the cheaper plan wins a tie (bytes; the predicted latency under a latency budget). So the result is never
    worse, beyond the sampling error, than a uniform candidate that fits. ``report.verified`` lists predicted vs
    measured (± error) for each plan and ``report.recommendation`` says why the returned one was chosen.
    ``calibration``: samples for configs that need calibration.
    """
    import pandas as pd

    from workbench import tasks
    from workbench.analysis.cache import fingerprint
    from workbench.analysis.sensitivity import sensitivity

    check_model(model)
    if isinstance(task, str):
        task = tasks.load(task)
    if isinstance(budget, int) and not isinstance(budget, bool):
        budget = Budget.size(budget)
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a wb.Budget (e.g. wb.Budget.size_fraction(0.35)) or an int of bytes, "
                        f"got {type(budget).__name__}")
    evaluation = _evaluation(verify)
    cand = cands_mod.normalize(candidates)
    if table is None:
        table = sensitivity(model, task, dict(cand), layers, quick=quick, calibration=calibration,
                            latency=budget.resource == "latency_ms", progress=progress, **sensitivity_options)
    else:
        fp = table.attrs.get("fingerprint")
        if fp is not None and fp != fingerprint(model):
            raise ValueError("the sensitivity table was measured on a different model (fingerprints differ)")
        labels = {lbl for lbl, _ in cand}
        table = table[table["candidate"].isin(labels)]
        if layers is not None:
            from workbench.analysis.sensitivity import select_layers

            table = table[table["layer"].isin(select_layers(model, cand, layers))]
    metric = table.attrs.get("metric", task.primary.name)
    higher = table.attrs.get("higher_is_better", task.metric(metric).higher_is_better)
    base = float(table.attrs.get("base", table["base"].iloc[0] if len(table) else float("nan")))
    base_quick = table.attrs.get("quick")
    if evaluation == "quick" and metric != task.primary.name:
        raise ValueError(f"metric {metric!r} is not evaluated on the quick subset (only {task.primary.name!r} is); "
                         f"verify on the full evaluation (verify='full')")

    options = _options(table, budget.resource, keep)
    current = float(table.groupby("layer", sort=False)[RESOURCES[budget.resource][0]].first().sum())
    limit = budget.limit * current if budget.relative else float(budget.limit)
    minimum = float(sum(min(c for _, _, c in opts) for opts in options.values()))
    chosen = solve(options, limit)

    configs = {lbl: c for lbl, c in cand}
    proposals = _proposals(options, chosen, limit, keep, n_verify) if evaluation else [("searched", chosen)]
    verified = []
    for label, choice in proposals:
        r = _report_for(choice, options, configs, budget, limit, minimum, current, metric, higher, base)
        r[1].base_quick = None if base_quick is None else bool(base_quick)
        row = {"plan": label, "predicted": r[1].predicted_quality, "measured": float("nan"),
               "measured_error": float("nan"), "predicted_cost": r[1].predicted_cost,
               "measured_cost": float("nan"), "fits": True, "chosen": False}
        if evaluation:
            _verify(model, task, r[0], r[1], list(choice), calibration, evaluation, progress)
            # bytes are exact; a latency budget is judged on the prediction (one timing of a plan is noisy)
            cost = r[1].measured_cost if budget.resource == "size_bytes" else r[1].predicted_cost
            row.update(measured=r[1].measured_quality, measured_error=r[1].measured_error,
                       measured_cost=r[1].measured_cost, fits=bool(cost <= limit * (1 + 1e-9)), _cost=cost)
            if r[1].measured_quick is not None:
                q = r[1].measured_quick
                row["measured_quick"] = float(q.quality.get(metric, float("nan")))
                row["measured_quick_error"] = float(q.quality_error.get(metric, float("nan")))
        verified.append({**row, "_r": r})
    best = verified[0]
    if evaluation:
        best, why = _recommend(verified, higher, RESOURCES[budget.resource][2])
    best["chosen"] = True
    plan, report = best["_r"]
    if evaluation:
        report.recommendation = why
        for v in verified:
            v["vs_recommended"] = ("recommended" if v is best else _versus(v, best, higher)[0]
                                   if np.isfinite(v["measured"]) else "not measured")
    report.verified = pd.DataFrame([{k: v for k, v in row.items() if not k.startswith("_")} for row in verified])
    if evaluation and best is not verified[0]:
        first = verified[0]
        report.notes.append(f"the knapsack's plan (predicted {first['predicted']:.4f}) measured "
                            f"{_pm(first['measured'], first['measured_error'])}; {best['plan']!r} is returned "
                            f"(see the recommendation)")
    return plan, report


def _evaluation(verify: bool | str) -> str:
    """``verify`` as "full", "quick", "both" or "" (no verification)."""
    if verify is True:
        return "full"
    if verify is False:
        return ""
    if verify not in VERIFY:
        raise ValueError(f"verify must be True (= 'full'), False or one of {list(VERIFY)}, got {verify!r}")
    return str(verify)


def _versus(a: Mapping, b: Mapping, higher: bool) -> tuple[str, str]:
    """How plan ``a``'s measured quality reads against ``b``'s: ("better" | "worse" | "tie", text such as
    "0.9722 vs 0.9759, ±0.019"). Without a stated error on either side, any difference counts.

    The two measurements score the same examples, so their errors are positively correlated and a paired
    statistic would be tighter; `Metrics` keeps no per-example scores and `workbench.measurement.sampling`
    offers no paired comparison, so this combines the two half-widths as independent (`combined_halfwidth`):
    conservative - it errs towards calling a difference a tie, never towards a phantom win."""
    from workbench.measurement.sampling import combined_halfwidth

    ea, eb = a["measured_error"], b["measured_error"]
    h = combined_halfwidth(ea if np.isfinite(ea) else None, eb if np.isfinite(eb) else None)
    diff = a["measured"] - b["measured"]
    text = f"{a['measured']:.4f} vs {b['measured']:.4f}"
    if h is None:
        text += ", no sampling error stated"
    else:
        text += f", ±{_err(h)}"
    if diff == 0 or (h is not None and abs(diff) <= h):
        return "tie", text
    return ("better" if (diff > 0) == higher else "worse"), text


def _recommend(verified: list[dict], higher: bool, unit: str) -> tuple[dict, str]:
    """The plan to return among the measured ones, and a sentence saying why: of the plans that fit, those no
    other plan that fits beats beyond the sampling error; of these the cheapest (then the best measured)."""
    sign = 1 if higher else -1
    usable = [v for v in verified if v["fits"] and np.isfinite(v["measured"])]
    if not usable:
        best = verified[0]
        return best, (f"recommended: {best['plan']!r} - no measured plan fits the budget "
                      f"({'nothing measured' if not np.isfinite(best['measured']) else 'over the budget'})")
    beaten = {id(v): next((w for w in usable if _versus(w, v, higher)[0] == "better"), None) for v in usable}
    eligible = [v for v in usable if beaten[id(v)] is None]
    best = min(eligible, key=lambda v: (v["_cost"], -sign * v["measured"]))
    parts, tied = [], False
    for v in verified:
        if v is best or not np.isfinite(v["measured"]):
            continue
        verdict, text = _versus(best, v, higher)
        name = v["plan"] if str(v["plan"]).startswith(("uniform", "searched")) else repr(v["plan"])
        if verdict == "tie":
            tied = True
            part = f"ties {name} ({text})"
            if v["_cost"] > best["_cost"]:
                part += f" and costs less ({best['_cost']:,.6g} vs {v['_cost']:,.6g} {unit})"
            elif v["_cost"] < best["_cost"]:
                other = beaten.get(id(v))
                part += (f", which costs less ({v['_cost']:,.6g} {unit}) but is beaten beyond the sampling error "
                         f"by {other['plan']}" if other is not None else
                         f", which costs less ({v['_cost']:,.6g} {unit}) but is over the budget")
            else:
                part += " at the same cost"
        elif verdict == "better":
            part = f"beats {name} ({text})"
        else:
            part = f"falls behind {name} ({text})" + ("" if v["fits"] else ", which is over the budget")
        parts.append(part)
    head = (f"recommended: {best['plan']!r} ({_pm(best['measured'], best['measured_error'])}, "
            f"{best['_cost']:,.6g} {unit})")
    why = f"{head}: it " + "; ".join(parts) if parts else f"{head}: the only plan measured"
    if tied:
        why += (". A difference inside the sampling error (95 %, both plans' errors combined) is a tie, and the "
                "cheaper plan wins a tie")
    return best, why


def _proposals(options, chosen: dict[str, str], limit: float, keep: bool, n: int) -> list[tuple[str, dict]]:
    """Plans worth measuring: the knapsack optimum, knapsack optima under slightly tighter limits (a different
    trade-off when the additive prediction is off), and every uniform candidate that fits the budget."""
    out: list[tuple[str, dict]] = [("searched", chosen)]
    seen = [chosen]
    for f in (0.95, 0.9):
        if len(out) >= n:
            break
        try:
            alt = solve(options, limit * f)
        except ValueError:   # tighter than the smallest achievable total
            break
        if alt not in seen:
            seen.append(alt)
            out.append((f"searched at {f:.0%} of the budget", alt))
    labels = [o[0] for layer_opts in options.values() for o in layer_opts if o[0] != KEEP]
    for lbl in dict.fromkeys(labels):
        choice = {}
        for layer, opts in options.items():
            names = [o[0] for o in opts]
            if lbl in names:
                choice[layer] = lbl
            elif KEEP in names:
                choice[layer] = KEEP
            else:
                choice = None
                break
        if choice is None or choice in seen:
            continue
        cost = sum(next(o[2] for o in options[layer] if o[0] == opt) for layer, opt in choice.items())
        if cost <= limit * (1 + 1e-9):
            seen.append(choice)
            out.append((f"uniform {lbl}", choice))
    return out


def _report_for(choice, options, configs, budget, limit, minimum, current, metric, higher, base):
    import pandas as pd

    rows = []
    for layer, option in choice.items():
        _, loss, cost = next(o for o in options[layer] if o[0] == option)
        rows.append({"layer": layer, "option": option, "loss": loss, "cost": cost})
    choices = pd.DataFrame(rows, columns=["layer", "option", "loss", "cost"])
    plan = Plan([(layer, configs[option]) for layer, option in choice.items() if option != KEEP])
    total_loss = float(choices["loss"].sum())
    report = SearchReport(budget=budget, limit=limit, minimum=minimum, current=current, metric=metric,
                          higher_is_better=higher, base_quality=base,
                          predicted_quality=base - total_loss if higher else base + total_loss,
                          predicted_cost=float(choices["cost"].sum()), choices=choices)
    return plan, report


def _verify(model, task, plan: Plan, report: SearchReport, layers, calibration, evaluation: str,
            progress) -> None:
    """Apply ``plan`` and measure it on ``evaluation`` ("full", "quick" or "both": the full one is recorded as
    ``measured``, the quick one beside it as ``measured_quick``)."""
    from workbench.analysis.sweep import apply_with_task
    from workbench.measurement.metrics import measure

    compressed = apply_with_task(model, task, plan, calibration, progress) if len(plan) else model
    metrics = measure(compressed, task, quick=evaluation == "quick", progress=progress)
    report.measured = metrics
    report.evaluation = "quick" if evaluation == "quick" else "full"
    report.measured_quality = float(metrics.quality.get(report.metric, float("nan")))
    report.measured_error = float(metrics.quality_error.get(report.metric, float("nan")))
    if evaluation == "both":
        report.measured_quick = measure(compressed, task, quick=True, progress=progress)
    report.measured_cost = _searched_cost(compressed, task, layers, report.budget.resource)
    if report.budget.resource == "latency_ms":
        reference = measure(model, task, quick=True, progress=False)
        report.notes.append(f"whole-model latency: {reference.latency_ms:.4g} ms -> {metrics.latency_ms:.4g} ms "
                            f"(the budget counts the searched layers' own latency)")
