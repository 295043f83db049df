"""Write notebooks/12_ptq_algorithms.ipynb from the cells below (run after editing them):

    cd tools && ../.venv/bin/python make_12_ptq_algorithms_notebook.py
"""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# 12 · Post-training quantization algorithms: RTN, GPTQ, AWQ, SmoothQuant

Round-to-nearest (RTN) quantizes every weight on its own. The algorithms in this lesson look at a few
**calibration** inputs X of each layer and choose the quantized weights Ŵ to keep the layer's *output* intact:

$$\\min_{\\hat W \\in \\text{grid}} \\; \\lVert X W^\\top - X \\hat W^\\top \\rVert^2
\\qquad\\text{(we plot it relative: } \\lVert X (W-\\hat W)^\\top\\rVert^2 / \\lVert X W^\\top\\rVert^2 \\text{)}$$

| method | idea | data |
|---|---|---|
| RTN | round each weight to the nearest grid point | none |
| GPTQ | quantize column by column; push each column's rounding error onto the columns not yet quantized | Hessian $H = 2X^\\top X / n$ |
| AWQ | scale input channel $j$ by $s_j = \\overline{|x_j|}^{\\alpha}$ before rounding, so channels with large activations get finer steps | mean $|x_j|$ |
| SmoothQuant | for W8A8: divide activation outliers by $s_j$ and multiply the weights by it | max $|x_j|$, max $|W_{:,j}|$ |

You will step through GPTQ and AWQ on one real MiniLM layer, then measure all four on MiniLM (sentence-embedding
fidelity) and tiny-lm (perplexity). Exercises are marked **Exercise**: replace the `...`, run the cell, read
the feedback."""),
    new_code_cell("""# Parameters (papermill replaces these values when the notebook runs as a report or a regression test)
solutions = False                                    # True fills in every exercise (the regression run)
calibration_samples = 8                              # MiniLM documents / tiny-lm windows, 128 tokens each
layer = "encoder.layer.5.intermediate.dense"         # the MiniLM layer we step through (384 -> 1536)
bits = 3                                             # bit width of the step-through
group_size = 64                                      # one fp16 scale per 64 weights of a row
minilm_pattern = "encoder.layer.5.*"                 # MiniLM layers quantized in the whole-model comparison
tinylm_pattern = "h.*"                               # tiny-lm: every Linear of the four blocks
bits_list = [4, 3]
smooth_alpha = 0.5                                   # SmoothQuant's migration strength
threads = 1                                          # CPU threads: 1 is robust on a shared machine, 2 faster on an idle one""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb
from workbench.quantization import formats, gptq

torch.set_num_threads(threads)
P = wb.teach.ptq                     # this lesson's figures, helpers and exercise checks
wb.teach.reset()"""),
    new_markdown_cell("""## 1. One real layer and what it sees

We record the inputs of one MiniLM feed-forward layer on a few calibration documents (disjoint from the
documents the fidelity is measured on) and, for later, on held-out documents."""),
    new_code_cell("""model = wb.models.load("minilm")
task = wb.tasks.load("minilm")
calibration = task.calibration(calibration_samples)
X = P.layer_inputs(model, layer, calibration)                   # (tokens, K) calibration inputs
X_held = P.layer_inputs(model, layer, [task.example_inputs(8)])  # (tokens, K) held-out documents
linear = model.get_submodule(layer)
W = linear.weight.detach()                                      # (N, K) = (out, in)
print(f"{layer}: W {tuple(W.shape)}, calibration tokens {X.shape[0]}, held-out tokens {X_held.shape[0]}")"""),
    new_markdown_cell("""## 2. GPTQ, one column at a time

GPTQ quantizes column $j$ (all weights that multiply input channel $j$), then corrects the columns it has not
quantized yet so that the layer's output moves as little as possible. With $U$ the upper Cholesky factor of
$H^{-1}$ (damped: $H + \\lambda I$, $\\lambda$ = 1 % of the mean diagonal):

$$q_j = \\text{round}(w_j), \\qquad e_j = \\frac{w_j - q_j}{U_{jj}}, \\qquad
W_{:,\\,k} \\leftarrow W_{:,\\,k} - e_j\\, U_{jk} \\quad (k > j)$$

The package applies the feedback lazily in blocks of 128 columns (same result, fewer memory passes) and picks
each group's scale when the group starts, from the *updated* weights. `P.gptq_trace` runs exactly that loop and
records, every 16 columns, the layer-output error of *quantized columns + the rest as they stand now*. For RTN
the rest is untouched; for GPTQ it has absorbed the feedback."""),
    new_code_cell("""trace = P.gptq_trace(W, X, bits=bits, group_size=group_size)
P.gptq_error_figure(trace).show()"""),
    new_markdown_cell("""RTN's error grows with every column it rounds. GPTQ's grows much more slowly: the columns still in float
soak up most of each rounding error. The heatmap shows *where* the weights moved — drag the slider. Left of the
dashed line: quantized columns (rounding + feedback); right of it: columns that have only received feedback so
far. Later columns accumulate more feedback, and the last ones have nobody left to pass their error to."""),
    new_code_cell("""P.gptq_update_figure(trace).show()"""),
    new_markdown_cell("""The step-through is the package's algorithm, not an illustration of it: its final weights are bit-identical
to `gptq.gptq_quantize`, which `wb.quant.WeightOnly(method="gptq")` calls for every layer."""),
    new_code_cell("""fmt = formats.IntFormat(bits, group_size)
package_weight = formats.decode(gptq.gptq_quantize(W, [(X,)], fmt), fmt, W.shape[1])
trace_matches_package = torch.equal(trace.weight, package_weight)
print("step-through == package GPTQ:", trace_matches_package)
print(f"relative output error on the calibration tokens: RTN {trace.rtn_error[-1]:.4f}, "
      f"GPTQ {trace.gptq_error[-1]:.4f} ({trace.rtn_error[-1] / trace.gptq_error[-1]:.1f}x lower)")"""),
    new_markdown_cell("""### Exercise 1 — one step of error feedback

`toy` is the top-left 6 × 4 corner of the layer, with `toy.U` (the factor $U$ for those 4 columns) and
`toy.q0` (column 0 rounded). Compute the remaining columns `toy.W[:, 1:]` after column 0's error is fed
forward. (`torch.outer(a, b)` is the outer product.)"""),
    new_code_cell("""toy = P.feedback_example(W, X, bits=bits)
# Exercise 1 - replace ... with the updated columns 1..3 (a 6 x 3 tensor)
answer = ...
answer = toy.W[:, 1:] - torch.outer((toy.W[:, 0] - toy.q0) / toy.U[0, 0], toy.U[0, 1:]) if solutions else answer
P.check_feedback_update(answer, toy)"""),
    new_markdown_cell("""## 3. AWQ: protect the channels that see large activations

An error $\\delta$ on weight $W_{ij}$ costs $\\delta \\cdot x_j$ in the output, so channels with large $|x_j|$
matter most. AWQ multiplies input channel $j$ by $s_j$ before rounding and divides the input by $s_j$ at run
time — the same product, but the salient channels' weights now span more grid steps:

$$y = (x / s)\\; Q\\big(W \\operatorname{diag}(s)\\big)^\\top, \\qquad s_j = \\overline{|x_j|}^{\\,\\alpha}
\\Big/ \\sqrt{\\max_k s_k \\min_k s_k}, \\qquad \\alpha^* = \\arg\\min_{\\alpha \\in \\{0, 0.05, \\dots, 1\\}}
\\lVert X W^\\top - (X/s)\\, Q(W\\operatorname{diag}(s))^\\top \\rVert^2$$

$\\alpha = 0$ is plain RTN, so on the calibration data AWQ is never worse than RTN. (The package then also
searches, per group, how much to clip the range; `P.awq_grid` shows the scale search, computed as
`awq.awq_search` computes it.)"""),
    new_code_cell("""grid, x_mean, s = P.awq_grid(W, X, bits=bits, group_size=group_size)
awq_alpha = float(grid.loc[grid["relative_error"].idxmin(), "alpha"])
print(f"chosen alpha {awq_alpha}: relative output error {grid['relative_error'].min():.4f} "
      f"vs {grid['relative_error'].iloc[0]:.4f} for RTN (alpha = 0)")
P.awq_loss_figure(grid).show()"""),
    new_code_cell("""print("channels with the largest mean |x|:", x_mean.topk(3).indices.tolist())
P.awq_scales_figure(x_mean, s, awq_alpha).show()"""),
    new_markdown_cell("""A handful of channels see activations many times larger than the rest. Look back at RTN's error curve
in section 2: its biggest jump comes when RTN reaches the largest of these channels. AWQ gives exactly those
channels the largest scales, so their weights are rounded on a finer effective grid."""),
    new_markdown_cell("""### Exercise 2 — AWQ's scales

`s_raw` holds $\\overline{|x_j|}^{\\alpha}$ for the chosen `awq_alpha` (clamped at 1e-4, as the package does).
Normalise it into AWQ's scales $s$."""),
    new_code_cell("""# Exercise 2 - replace ... with the normalised scales s (a tensor of shape (K,))
s_raw = x_mean.pow(awq_alpha).clamp(min=1e-4)   # (given) mean|x|^alpha, clamped
answer = ...
answer = s_raw / (s_raw.max() * s_raw.min()).sqrt() if solutions else answer
P.check_awq_scales(answer, x_mean, awq_alpha)"""),
    new_markdown_cell("""## 4. SmoothQuant: make activations easy for W8A8

W8A8 also quantizes the *activations* to int8 (here per token, at run time). One token's scale is set by its
largest value, so a few outlier channels waste the grid for all the others. SmoothQuant divides channel $j$ of
the activations by $s_j$ and multiplies the matching weight column by it:

$$s_j = \\frac{\\max |X_{:,j}|^{\\alpha}}{\\max |W_{:,j}|^{1-\\alpha}}, \\qquad
X W^\\top = (X \\operatorname{diag}(s)^{-1})\\,(W \\operatorname{diag}(s))^\\top$$"""),
    new_code_cell("""view = P.smoothing_view(X, W, smooth_alpha)
P.smoothing_figure(view, smooth_alpha).show()"""),
    new_markdown_cell("""### Exercise 3 — SmoothQuant's factors

Compute $s$ (one value per input channel) for `X`, `W` and `smooth_alpha`. Ignore the package's guards
against zeros — none of these channels is zero."""),
    new_code_cell("""# Exercise 3 - replace ... with the smoothing factors s (a tensor of shape (K,))
answer = ...
answer = X.abs().amax(dim=0) ** smooth_alpha / W.abs().amax(dim=0) ** (1 - smooth_alpha) if solutions else answer
P.check_smoothing_factors(answer, X, W, smooth_alpha)"""),
    new_markdown_cell("""## 5. Calibrated is not the same as better: held-out tokens

Each method was fitted on the calibration tokens. With this little calibration data (about a thousand tokens
for a 384 × 384 Hessian) GPTQ partly fits the calibration set, and its advantage shrinks on held-out
documents; AWQ, which only chooses one $\\alpha$ and a clipping ratio per group, loses little. W8A8 is an
order of magnitude more accurate than any 3-bit weight format, and SmoothQuant lowers its error further."""),
    new_code_cell("""errors = P.layer_errors(linear, X, X_held, bits=bits, group_size=group_size, smooth_alpha=smooth_alpha)
awq_matches_package = errors.attrs["awq_alpha"] == awq_alpha and torch.equal(errors.attrs["awq_scales"], s)
print(f"the package's AWQ (awq.awq_search) chose alpha {errors.attrs['awq_alpha']}, the same scales as the grid "
      f"above: {awq_matches_package}")
P.layer_errors_figure(errors).show()
errors"""),
    new_markdown_cell("""## 6. Whole models

Now every method on real models through the package's plans (`wb.quant.WeightOnly(bits, group_size,
method=...)`, `wb.quant.Dynamic(smooth_alpha=...)`, built by `P.ptq_plans`): every Linear of MiniLM's last block
(the block our layer belongs to) and every Linear of tiny-lm's four blocks. Quality is measured on held-out data
in quick mode (MiniLM: fidelity to the fp32 embeddings of 32 documents; tiny-lm: perplexity of 64 windows), size
in real bytes. GPTQ and AWQ are calibrated on the same samples as above, with layer inputs recorded from the
float model."""),
    new_code_cell("""minilm_results = P.measure_plans(model, task, P.ptq_plans(minilm_pattern, bits_list, group_size, smooth_alpha),
                                 calibration)
lm = wb.models.load("tiny-lm")
lm_task = wb.tasks.load("tiny-lm")
lm_results = P.measure_plans(lm, lm_task, P.ptq_plans(tinylm_pattern, bits_list, group_size, smooth_alpha),
                             lm_task.calibration(calibration_samples))
minilm_results.merge(lm_results, on="label", suffixes=(" minilm", " tiny-lm"))"""),
    new_code_cell("""P.results_figure({"minilm": minilm_results, "tiny-lm": lm_results}).show()"""),
    new_markdown_cell("""Read the bars as *how much quality each plan costs* (log scale: one grid line is 10×). Calibrated methods
help most where RTN hurts most (3 bits); W8A8 costs far less than 4-bit weights but stores 8 bits per weight."""),
    new_code_cell("""minilm_table = P.method_table(minilm_results, "fidelity")
lm_table = P.method_table(lm_results, "perplexity")
minilm_table"""),
    new_markdown_cell("""### Exercise 4 — read the measurement

Which weight-only method (`"rtn"`, `"gptq"` or `"awq"`) gave MiniLM the highest fidelity at `bits` bits in
*your* run? Answer with a string, or read it off `minilm_table` with code."""),
    new_code_cell("""# Exercise 4 - replace ... with "rtn", "gptq" or "awq"
answer = ...
answer = minilm_table[bits].idxmax() if solutions else answer
P.check_best_method(answer, minilm_table, bits=bits)"""),
    new_markdown_cell("""## Summary

- RTN is data-free and fast; at 4 bits it is often good enough, at 3 bits it is not.
- GPTQ spends a Hessian and a Cholesky factorisation per layer to feed rounding errors forward; it cuts the
  calibration error the most, but can fit the calibration tokens — more (and more varied) calibration data helps.
- AWQ only chooses per-channel scales (and clipping): cheap to store, robust on new data.
- SmoothQuant is for W8A8: it moves activation outliers into the weights before both are quantized to int8.

The values below are recorded in the notebook's outputs; the regression suite compares them with
`data/golden/12_ptq_algorithms.json`."""),
    new_code_cell("""done = wb.teach.summary()
minilm_q = dict(zip(minilm_results["label"], minilm_results["fidelity"]))
lm_q = dict(zip(lm_results["label"], lm_results["perplexity"]))
layer_err = dict(zip(errors["method"], errors["held_out"]))
wb.reports.record(
    trace_matches_package=trace_matches_package,
    layer_rtn_error=trace.rtn_error[-1],
    layer_gptq_error=trace.gptq_error[-1],
    awq_alpha=awq_alpha,
    held_out_rtn_error=layer_err[f"W{bits} rtn"],
    held_out_gptq_error=layer_err[f"W{bits} gptq"],
    held_out_awq_error=layer_err[f"W{bits} awq"],
    awq_matches_package=awq_matches_package,
    **{f"minilm_{k.lower().replace(' + ', '_').replace(' ', '_')}": v for k, v in minilm_q.items()},
    **{f"tinylm_{k.lower().replace(' + ', '_').replace(' ', '_')}": v for k, v in lm_q.items()},
    minilm_w4_size_ratio=float(minilm_results.loc[minilm_results["label"] == "W4 rtn", "size_ratio"].iloc[0]),
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("12_ptq_algorithms", cells)
