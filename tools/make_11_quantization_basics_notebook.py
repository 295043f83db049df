"""Write notebooks/11_quantization_basics.ipynb, the workshop lesson on the basics of integer quantization:
the affine mapping, symmetric vs asymmetric, granularity (per tensor / channel / group) and the bytes it costs,
clipping and observers, and how much calibration data a range needs - on a real MiniLM layer.
Lesson module: workbench/teach/basics.py. Run after editing the cells:

    cd tools && ../.venv/bin/python make_11_quantization_basics_notebook.py
"""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# 11 · Quantization basics: scales, granularity, clipping and calibration

Lesson 10 showed that a low-bit integer grid needs a **scale**, and that one large value can ruin a per-tensor
scale. This lesson is about choosing scales well, on one real MiniLM layer: its weights `w` and its input
activations `a` (after the GELU), recorded on real sentences.

1. the affine mapping, by hand;
2. symmetric vs asymmetric ranges;
3. granularity: one scale per tensor, per output channel, or per group of weights - and what the scales cost;
4. clipping: a smaller range than min-max, and the observers that choose it;
5. calibration: how many sentences an observer needs.

Every number comes from the package: `wb.quant.primitives` (quantize / dequantize / qparams),
`wb.quant.formats` (the bytes really stored) and `wb.quant.observers`. Four exercises; replace each `...`."""),
    new_code_cell("""# Parameters (papermill replaces these values; the regression run sets solutions = True)
solutions = False                           # True fills in the exercises
layer = "encoder.layer.0.output.dense"      # the MiniLM layer: its weights and its inputs (post-GELU activations)
act_bits = 8                                # bit-width of the activations in sections 4 and 5 (try 6)
calibration_pool = 64                       # calibration sentences recorded (the largest calibration set)
observer_samples = 16                       # sentences the observers of section 4 calibrate on
eval_sentences = 4                          # held-out sentences on which activation errors are measured
calibration_sizes = [1, 2, 4, 8, 16, 32]    # calibration-set sizes tried in section 5 (at most calibration_pool)
draws = 3                                   # random calibration sets per size
threads = 1                                 # CPU threads (small tensor ops run best on one thread)""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import pandas as pd
import torch

import workbench as wb

torch.set_num_threads(threads)
B = wb.teach.basics
P = wb.quant.primitives
model = wb.models.load("minilm")
task = wb.tasks.load("minilm")
w = model.get_submodule(layer).weight.detach()                                            # (out, in)
pool = B.layer_inputs(model, layer, task.calibration(calibration_pool), mask_index=1)     # per sentence: (tokens, in)
a_eval = torch.cat(B.layer_inputs(model, layer, [task.example_inputs(eval_sentences)], mask_index=1))  # held out
a = torch.cat(pool[:observer_samples])                                                     # (tokens, in)
print(f"w {tuple(w.shape)}; calibration: {len(pool)} sentences; held-out activations {tuple(a_eval.shape)}")"""),
    new_markdown_cell("""## 1. The affine mapping

With *b* bits, a scale *s* and an integer zero point *z*, a value becomes a code and back:

```
q     = clamp(round(x / s) + z, qmin, qmax)       signed: [-2^(b-1), 2^(b-1) - 1]   unsigned: [0, 2^b - 1]
x_hat = (q - z) · s
```

The grid is `{(q - z) · s}`: evenly spaced by *s*, from `(qmin - z) · s` to `(qmax - z) · s`. Inside it the error
is at most s / 2 (rounding); outside it values are **clipped** to the ends. The zero point makes 0 exactly
representable, which matters for zero padding and ReLU outputs.

### Exercise 1 · quantize and dequantize by hand

Unsigned 4-bit codes (0 ... 15), s = 0.05, z = 3. The vector `v` holds values like the GELU outputs of this
layer (the GELU's minimum is about -0.17)."""),
    new_code_cell("""v = torch.tensor([-0.17, -0.05, 0.0, 0.12, 0.31, 0.58, 0.9, 2.4])
s, z = 0.05, 3"""),
    new_code_cell("""# Exercise 1 - x_hat for v (a tensor like v). Replace ... with your code.
answer = ...
answer = (torch.clamp(torch.round(v / s) + z, 0, 15) - z) * s if solutions else answer
B.check_fake_quant(answer, v, scale=s, zero_point=z, bits=4)"""),
    new_markdown_cell("""## 2. Symmetric or asymmetric

`primitives.choose_qparams` picks (s, z) from a range [lo, hi] (which always includes 0):

```
symmetric:   s = max(|lo|, |hi|) / ((qmax - qmin) / 2)     z = 0
asymmetric:  s = (hi - lo) / (qmax - qmin)                 z = qmin - round(lo / s)
```

Symmetric is simpler (no zero point to store or subtract) but reserves half of the codes for negative values.
The GELU output is almost one-sided (nothing below -0.17), so half of a symmetric grid is wasted on it."""),
    new_code_cell("""sym = B.symmetry_table({"weights (per channel)": w}, granularity=P.PerChannel(0))
sym = pd.concat([sym, B.symmetry_table({"activations (per tensor)": a})], ignore_index=True)
B.symmetry_figure(sym).show()
sym.drop(columns="mse").round(2)"""),
    new_markdown_cell("""### Exercise 2 · how many codes does symmetric int8 use on the activations?

An 8-bit tensor has 256 codes. Quantize `a` symmetrically per tensor with
`P.quantize_affine(a, 8, P.PerTensor(), symmetric=True)` (it returns codes, scale, zero point) and count the
distinct codes that occur. Two things waste codes here: the negative half, and the outliers that stretch the
range."""),
    new_code_cell("""# Exercise 2 - the number of distinct int8 codes in symmetric per-tensor quantization of a.
answer = ...
answer = P.quantize_affine(a, 8, P.PerTensor(), symmetric=True)[0].unique().numel() if solutions else answer
B.check_codes_used(answer, a, bits=8)"""),
    new_markdown_cell("""## 3. Granularity: how many weights share a scale

One scale for the whole tensor is at the mercy of its largest value. Finer granularity gives each part of the
tensor its own range (`primitives.PerTensor()`, `PerChannel(0)`: one scale per output row, `PerGroup(g)`:
one per *g* consecutive input weights of a row). The price is storage: every scale is an fp16 number, 2 bytes,
shared by the weights of its group:

```
bytes per weight = bits / 8 + 2 / g   (+ 1 / g for a uint8 zero point, asymmetric only)
```

The bytes below are *measured* from the tensors `wb.quant.formats.encode` stores (the format `WeightOnly`
layers keep): packed codes plus fp16 scales."""),
    new_code_cell("""{name: (tuple(t.shape), str(t.dtype)) for name, t in wb.quant.formats.encode(w, wb.quant.formats.IntFormat(4, 64)).items()}"""),
    new_code_cell("""print(f"largest |w|: {w.abs().max():.3f}; median of the rows' largest |w|: {w.abs().amax(dim=1).median():.3f}")
granularity = B.granularity_table(w, bits=(8, 4), group_sizes=(16, 32, 64, 128, 256))
B.granularity_figure(granularity).show()
granularity.drop(columns="mse").round(4)"""),
    new_markdown_cell("""Per-channel scales recover most of what per-tensor loses on this layer: its largest weights sit in a few rows,
so one row's outlier no longer sets the step of all the others. Groups go further, at a cost in bytes that grows
as the groups shrink (right panel: the upper-left points are the efficient ones).

### Exercise 3 · bytes per weight of int4 with groups of 64

Symmetric int4, one fp16 scale per group of 64 weights: how many **bytes** does one weight cost, scales
included?"""),
    new_code_cell("""# Exercise 3 - bytes per weight for int4, group size 64, fp16 scales (symmetric). Replace ... with a number.
answer = ...
answer = 4 / 8 + 2 / 64 if solutions else answer
B.check_bytes_per_weight(answer, bits=4, group_size=64)"""),
    new_markdown_cell("""## 4. Clipping: a smaller range on purpose

Activations are quantized with one range calibrated in advance (static quantization). Min-max covers every
value seen, so a handful of outliers sets a large step *s* for all the others. Clipping the range to [-t, t]
shrinks the step (less rounding error for the many values inside) but adds clipping error for the few outside:

```
MSE(t) ≈ (1/N) · [ Σ over |x| ≤ t of s²/12   +   Σ over |x| > t of (|x| - t)² ]        s = t / 127.5 (int8)
            rounding error, shrinks with t         clipping error, grows as t shrinks
```

Below, the MSE on **held-out** sentences as a function of t (`B.clipping_curve`, through `primitives.quantize`
/ `dequantize`), and the thresholds chosen by the package's observers after calibrating on other sentences:
min-max, the 99.9th and 99.99th percentile of the values, a search for the smallest MSE on (a sample of) the
calibration values, and TensorRT's entropy (KL) method on a histogram."""),
    new_code_cell("""curve = B.clipping_curve(a_eval, bits=act_bits, points=80)
observers = B.observer_table(pool[:observer_samples], a_eval, bits=act_bits)
B.clipping_figure(curve, observers, bits=act_bits).show()
observers.drop(columns="key").round(5)"""),
    new_markdown_cell("""### Exercise 4 · the best clipping threshold

`curve` has one row per threshold (`threshold`, `mse`, `clipped`: the fraction of values beyond it). Which
threshold gives the smallest MSE?"""),
    new_code_cell("""# Exercise 4 - the threshold with the smallest MSE in curve. Replace ... with your code.
answer = ...
answer = curve["threshold"][curve["mse"].idxmin()] if solutions else answer
B.check_best_clipping(answer, curve)"""),
    new_markdown_cell("""The best threshold clips only a tiny fraction of the values (hover over the curve). A percentile that is too
low clips real signal - here the outliers are few but matter - and the error climbs steeply to the left of the
minimum; min-max sits at the right end of the curve.

## 5. Calibration: how many sentences?

An observer only sees the calibration set. Below, each observer is calibrated on random sets of *n* sentences
(several draws per *n*, from the task's calibration split) and its threshold is scored on the held-out
sentences. What to look for:

- **min-max** can only grow as it sees more outliers, so more data never helps it;
- **percentile 99.99** averages one percentile per sentence, so it is stable from the first sentence on;
- **MSE** searches on a random sample of each sentence (8,192 values, to stay fast). With few sentences the
  sample holds too few of the rare large values, the search treats them as noise and clips them away; once the
  sample holds enough of the tail, the threshold moves up and the held-out error drops. How much calibration
  data is "enough" depends on how rare the important values are, not only on the number of sentences."""),
    new_code_cell("""calib = B.calibration_table(pool, a_eval, calibration_sizes, repeats=draws, bits=act_bits)
B.calibration_figure(calib).show()
calib.groupby(["observer", "samples"])["mse"].mean().unstack("observer")"""),
    new_markdown_cell("""## Summary

- `x_hat = (clamp(round(x / s) + z, qmin, qmax) - z) · s`: rounding error inside the range, clipping outside.
- Asymmetric ranges (a zero point) suit one-sided tensors such as GELU / ReLU outputs.
- Finer granularity lowers the error at a cost of 2 bytes per scale: int4 g64 costs 0.53 bytes per weight.
- Clipping trades a little clipping error for a smaller step; observers pick the threshold from calibration
  data, and the amount of calibration data changes what they pick.

The values below are recorded in the notebook's outputs; the regression suite compares them with
`data/golden/11_quantization_basics.json`."""),
    new_code_cell("""g = granularity.set_index(["bits", "granularity"])
largest = calib[calib["samples"] == max(calibration_sizes)].groupby("key")["mse"].mean()
best = curve.loc[curve["mse"].idxmin()]
done = wb.teach.summary()
wb.reports.record(
    **{f"weights_int{b}_{k.replace('-', '_')}_sqnr_db": g.loc[(b, k), "sqnr_db"]
       for b in (8, 4) for k in ("per-tensor", "per-channel", "g128", "g64", "g32")},
    int4_g64_bytes_per_weight=g.loc[(4, "g64"), "bytes_per_weight"],
    int8_per_channel_bytes_per_weight=g.loc[(8, "per-channel"), "bytes_per_weight"],
    activations_int8_symmetric_sqnr_db=sym.set_index(["tensor", "bits", "scheme"]).loc[
        ("activations (per tensor)", 8, "symmetric"), "sqnr_db"],
    activations_int8_asymmetric_sqnr_db=sym.set_index(["tensor", "bits", "scheme"]).loc[
        ("activations (per tensor)", 8, "asymmetric"), "sqnr_db"],
    best_clip_threshold=best["threshold"],
    best_clip_mse=best["mse"],
    minmax_clip_mse=curve["mse"].iloc[-1],
    **{f"observer_{k}_mse": v for k, v in zip(observers["key"], observers["mse"])},
    **{f"calibrated_{k}_mse_largest_set": v for k, v in largest.items()},
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("11_quantization_basics", cells)
