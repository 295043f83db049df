"""Lab 15's exercises: worked solutions (``_solution_*``), their checks (``check_*``) and what only they use."""
from __future__ import annotations

import functools
from typing import Mapping

from torch import nn

import workbench as wb  # the name the lesson's notebook (and its worked solutions) use
from workbench.analysis.search import KEEP, solve
from workbench.analysis.sweep import pareto
from workbench.measurement.footprint import size_bytes
from workbench.plans.apply import apply
from workbench.plans.plan import Plan
from workbench.teach import Feedback, check
from workbench.teach.sensitivity.figures import _greedy_reference, _lookup, _totals, measure_plan, predicted, to_plan

__all__ = ["check_scan", "check_layer_bytes", "check_plan_bytes", "check_predicted", "check_measured", "check_greedy",
           "check_knapsack", "check_best_verified", "check_pareto"]


# --- exercises: worked solutions (as a learner writes them) and checks ----------------------------------

def _solution_scan(model, task, layers, config, base):
    answer = {}
    for name in layers:
        changed = wb.apply(model, wb.Plan({name: config}), progress=False)
        answer[name] = base - task.evaluate(changed)[task.primary.name]
    return answer


def check_scan(answer, model: nn.Module, task, table, candidate: str, config) -> Feedback:
    """Exercise 1: ``{layer: loss}`` with only that layer quantized with ``candidate`` (loss = base - metric),
    compared with `wb.sensitivity`'s rows."""
    rows = table[table["candidate"] == candidate]
    expected = {r.layer: float(r.loss) for r in rows.itertuples()}
    base = float(table.attrs.get("base", rows["base"].iloc[0]))
    mistakes = [({k: -v for k, v in expected.items()}, "the sign: loss = base - quantized, positive when worse"),
                ({k: base - v for k, v in expected.items()}, "those are the accuracies; give the loss base - accuracy")]
    return check(f"single-layer scan at {candidate}", answer, expected, rtol=0, atol=1e-9,
                 hint="for each layer: wb.apply(model, wb.Plan({layer: config})) changes that layer only; evaluate "
                      "the copy on the whole test split and subtract from the base",
                 mistakes=mistakes, solution=functools.partial(_solution_scan, model, task, list(expected), config,
                                                               base))


def _solution_layer_bytes(weight, int4):
    out_features = weight.shape[0]
    codes = weight.numel() * int4.bits // 8     # packed: 8 // bits codes per byte
    scales = 2 * out_features                   # one fp16 scale per output channel
    bias = 4 * out_features                     # the fp32 bias stays
    return codes + scales + bias


def check_layer_bytes(answer, model: nn.Module, layer: str, config) -> Feedback:
    """Exercise 2: bytes of ``layer`` quantized with ``config`` (per output channel), measured from the module
    `wb.apply` builds."""
    compressed = apply(model, Plan({layer: config}), progress=False)
    expected = size_bytes(compressed.get_submodule(layer))
    w = model.get_submodule(layer).weight
    out, n, bits = w.shape[0], w.numel(), config.bits
    mistakes = [(n * bits // 8, "the codes alone: each output channel also stores an fp16 scale, and the bias "
                                "stays fp32"),
                (n * bits // 8 + 2 * out, "the bias is missing: it stays fp32 (4 bytes per output channel)"),
                (n * bits // 8 + 4 * out, "the scales are missing: one fp16 (2 bytes) per output channel"),
                (n * bits + 2 * out + 4 * out, "bits, not bytes: the codes take bits / 8 bytes each")]
    return check(f"bytes of {layer} at {bits} bits", answer, expected, rtol=0, atol=0,
                 hint="packed codes (bits / 8 bytes per weight) + fp16 scale per output channel + fp32 bias",
                 mistakes=mistakes, solution=functools.partial(_solution_layer_bytes, w.detach(), config))


def _solution_plan_bytes(opts, plan):
    total = 0
    for layer, choice in plan.items():
        total += next(nbytes for option, loss, nbytes in opts[layer] if option == choice)
    return total


def check_plan_bytes(answer, model: nn.Module, opts, plan: Mapping[str, str], configs: Mapping) -> Feedback:
    """Exercise 3: total bytes of the searched layers under ``plan``, measured on the applied model."""
    compressed = apply(model, to_plan(plan, configs), progress=False)
    expected = int(sum(size_bytes(compressed.get_submodule(n)) for n in plan))
    kept = sum(o[2] for o in _lookup(opts, plan) if o[0] == KEEP)
    mistakes = [(expected - kept, "the layers kept in fp32 count too: their bytes are the 'keep' option's"),
                (sum(o[0][2] for o in opts.values()), "that is every layer in fp32: look up the chosen option's bytes")]
    return check("bytes of a plan", answer, expected, rtol=0, atol=0,
                 hint="for each layer, the bytes of the option the plan chose (opts[layer] holds (option, loss, "
                      "bytes) triples); add them up",
                 mistakes=mistakes, solution=functools.partial(_solution_plan_bytes, opts, dict(plan)))


def _solution_predicted(opts, plan, base):
    lost = 0.0
    for layer, choice in plan.items():
        lost += next(loss for option, loss, nbytes in opts[layer] if option == choice)
    return base - lost


def check_predicted(answer, opts, plan: Mapping[str, str], base: float) -> Feedback:
    """Exercise 4: the additive prediction of the plan's metric."""
    expected = predicted(opts, plan, base)
    lost = base - expected
    mistakes = [(lost, "that is the predicted loss; the exercise asks for the predicted accuracy, base - loss"),
                (base + lost, "the losses are subtracted from the base (a loss > 0 means worse)")]
    return check("predicted accuracy of a plan", answer, expected, rtol=0, atol=1e-9,
                 hint="assume the single-layer losses add up: base minus the sum of the chosen options' losses",
                 mistakes=mistakes, solution=functools.partial(_solution_predicted, opts, dict(plan), base))


def _solution_measured(model, task, plan, configs):
    wb_plan = wb.Plan({layer: configs[option] for layer, option in plan.items() if option != "keep"})
    return task.evaluate(wb.apply(model, wb_plan, progress=False))[task.primary.name]


def check_measured(answer, model: nn.Module, task, plan: Mapping[str, str], configs: Mapping, opts,
                   base: float) -> Feedback:
    """Exercise 5: the plan's metric measured on the applied model."""
    expected, _ = measure_plan(model, task, plan, configs)
    mistakes = [(predicted(opts, plan, base), "that is the additive prediction; apply the plan and evaluate"),
                (base, "that is the unchanged model's accuracy: evaluate the model wb.apply returns")]
    return check("measured accuracy of a plan", answer, expected, rtol=0, atol=1e-9,
                 hint="wb.apply(model, wb.Plan({layer: configs[option], ...})) without the 'keep' layers, then "
                      "task.evaluate(...)",
                 mistakes=mistakes, solution=functools.partial(_solution_measured, model, task, dict(plan), configs))


def _solution_greedy(opts, budget):
    plan = {layer: choices[0][0] for layer, choices in opts.items()}     # start from the largest option
    step = dict.fromkeys(opts, 0)
    while sum(opts[layer][step[layer]][2] for layer in opts) > budget:
        best, best_rate = None, None
        for layer in opts:
            i = step[layer]
            if i + 1 < len(opts[layer]):
                extra_loss = opts[layer][i + 1][1] - opts[layer][i][1]
                saved = opts[layer][i][2] - opts[layer][i + 1][2]
                if best_rate is None or extra_loss / saved < best_rate:
                    best, best_rate = layer, extra_loss / saved
        step[best] += 1
        plan[best] = opts[best][step[best]][0]
    return plan


def _by_loss_greedy(opts, limit: float) -> dict[str, str]:
    """A plausible wrong greedy: the downgrade with the smallest added loss, ignoring the bytes it saves."""
    level = dict.fromkeys(opts, 0)
    while sum(opts[layer][i][2] for layer, i in level.items()) > limit:
        moves = [(opts[layer][i + 1][1] - opts[layer][i][1], order, layer)
                 for order, (layer, i) in enumerate(level.items()) if i + 1 < len(opts[layer])]
        level[min(moves)[2]] += 1
    return {layer: opts[layer][i][0] for layer, i in level.items()}


def check_greedy(answer, opts, budget: float) -> Feedback:
    """Exercise 6: the greedy plan under ``budget`` bytes."""
    expected = _greedy_reference(opts, budget)
    mistakes = [(_by_loss_greedy(opts, budget), "rank the downgrades by added loss *per byte saved*: a cheap "
                                                "downgrade of a small layer saves almost nothing"),
                (dict.fromkeys(opts, opts[next(iter(opts))][-1][0]), "that is every layer at the smallest "
                                                                     "option; stop as soon as the plan fits")]
    return check("greedy bit assignment", answer, expected, rtol=0, atol=0,
                 hint="start with every layer at its first option; while over budget, take the one-step downgrade "
                      "with the smallest (loss increase) / (bytes saved)",
                 mistakes=mistakes, solution=functools.partial(_solution_greedy, opts, budget))


def _solution_knapsack(opts, budget):
    partial = [({}, 0, 0.0)]                      # (choices so far, bytes, loss)
    for layer, choices in opts.items():
        grown = [({**plan, layer: option}, nbytes + b, lost + loss)
                 for plan, nbytes, lost in partial for option, loss, b in choices if nbytes + b <= budget]
        grown.sort(key=lambda p: (p[1], p[2]))    # by bytes; keep a partial plan only if it loses less than
        partial, best = [], None                  # every cheaper one (the others can never win)
        for p in grown:
            if best is None or p[2] < best:
                partial.append(p)
                best = p[2]
    plan, nbytes, lost = min(partial, key=lambda p: (p[2], p[1]))
    return plan


class _Then:
    """A worked solution whose answer is checked through ``after`` (its source is ``func``'s, for the reveal)."""

    def __init__(self, func, args: tuple, after):
        self.func, self.args, self.after = func, args, after

    def __call__(self):
        return self.after(self.func(*self.args))


def check_knapsack(answer, opts, budget: float) -> Feedback:
    """Exercise 7: an exact plan (least predicted loss within ``budget``; among those, the fewest bytes).
    Checked by its (total loss, bytes) against the package's MILP (`wb.analysis.solve`), so any optimal plan
    passes."""
    expected = _totals(opts, solve(opts, budget))
    name = "exact bit assignment (knapsack)"
    solution = _Then(_solution_knapsack, (opts, budget), lambda plan: _totals(opts, plan))
    if answer is ... or answer is None:
        return check(name, answer, expected, solution=solution)
    got = _totals(opts, answer) if isinstance(answer, Mapping) else None
    if got is None:
        return check(name, answer, expected, hint="return a dict {layer: option} covering every layer of opts",
                     solution=solution)
    greedy = _totals(opts, _greedy_reference(opts, budget))
    hint = ("(total loss, bytes) of your plan against the optimum's: keep, layer by layer, every partial plan "
            "within the budget that loses less than all cheaper ones; at the end take the least loss")
    if got[1] > budget:
        hint = f"that plan takes {got[1]:,} bytes, over the budget of {budget:,.0f}"
    mistakes = [(greedy, "that is the greedy plan's loss: greedy is not optimal; search all combinations (with "
                         "pruning)")] if greedy != expected else []
    return check(name, got, expected, hint=hint, rtol=0, atol=1e-9, mistakes=mistakes, solution=solution)


def _solution_best_verified(verified):
    import math

    fits = verified[verified["fits"]]
    # a plan is out when another plan that fits measures better by more than the two errors combined
    beaten = [any(o["measured"] - r["measured"] > math.hypot(o["measured_error"], r["measured_error"])
                  for _, o in fits.iterrows()) for _, r in fits.iterrows()]
    return fits[[not b for b in beaten]].sort_values(["measured_cost", "measured"],
                                                      ascending=[True, False])["plan"].iloc[0]


def check_best_verified(answer, verified, report) -> Feedback:
    """Exercise 8: the plan to return after verification (what `wb.search` returned: ``report.verified``'s chosen
    row): among the plans that fit, those that no other fitting plan beats by more than the sampling error
    (both plans' 95 % errors combined); of these, the cheapest."""
    chosen = report.verified[report.verified["chosen"]]
    expected = str(chosen["plan"].iloc[0])
    fits = verified[verified["fits"]]
    by_prediction = verified.loc[verified["predicted"].idxmax(), "plan"]
    by_measure = fits.loc[fits["measured"].idxmax(), "plan"]
    over = verified.loc[verified["measured"].idxmax(), "plan"]
    mistakes = [(m, h) for m, h in (
        (by_prediction, "that is the best *predicted* plan; choose on the measurement"),
        (by_measure, "that plan measures highest, but a cheaper plan ties it: the difference lies inside the "
                     "sampling error (combine the two measured_error values as sqrt(e1**2 + e2**2)), and the "
                     "cheaper of tied plans wins"),
        (over, "that plan does not fit the budget (column fits)")) if m != expected]
    return check("the plan that never loses to uniform", answer, expected,
                 hint="keep the rows with fits == True; drop each one that another of them beats by more than "
                      "sqrt(e1**2 + e2**2) (their measured_error); return the cheapest that is left "
                      "(measured_cost)",
                 mistakes=mistakes, solution=functools.partial(_solution_best_verified, verified))


def _solution_pareto(plans):
    front = []
    for i, p in plans.iterrows():
        dominated = ((plans["size_bytes"] <= p["size_bytes"]) & (plans["measured"] >= p["measured"])
                     & ((plans["size_bytes"] < p["size_bytes"]) | (plans["measured"] > p["measured"])))
        if not dominated.any():
            front.append(p["plan"])
    return front


def check_pareto(answer, plans) -> Feedback:
    """Exercise 9: the names of the plans on the measured Pareto front (fewer bytes, higher accuracy), in the
    table's order (`wb.pareto`)."""
    expected = list(plans.loc[pareto(plans, "size_bytes", "measured", y_higher_is_better=True), "plan"])
    wrong_way = list(plans.loc[pareto(plans, "size_bytes", "measured", y_higher_is_better=False), "plan"])
    best = plans["measured"].max()
    mistakes = [(wrong_way, "accuracy is higher-is-better: you kept the plans nothing beats on *low* accuracy"),
                (list(plans.loc[plans["measured"] == best, "plan"]), "the front has one plan per trade-off, not "
                                                                     "only the most accurate")]
    return check("the measured Pareto front", answer, expected,
                 hint="a plan is on the front when no other plan has fewer or equal bytes and higher or equal "
                      "accuracy, and is strictly better on one",
                 mistakes=[(m, h) for m, h in mistakes if m != expected],
                 solution=functools.partial(_solution_pareto, plans))
