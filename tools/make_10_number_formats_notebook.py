"""Write notebooks/10_number_formats.ipynb, the workshop lesson on number formats (int4 / int8 / fp8 / fp16 /
bf16): their grids, range vs precision, and their error on real MiniLM weights and activations and on a digits
CNN's logits. Lesson module: workbench/teach/formats.py. Run after editing the cells:

    cd tools && ../.venv/bin/python make_10_number_formats_notebook.py
"""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# 10 · Number formats: what a few bits can hold

Compressing a model mostly means storing its numbers with fewer bits. A format with *b* bits can hold at most
2^b different values - its **grid** - and every number is rounded to the nearest of them. Two properties
decide what a grid costs a tensor:

- **range**: the largest and the smallest non-zero magnitude it holds (beyond them values *overflow* or
  *underflow* to 0);
- **precision**: the gap between neighbouring values, which bounds the rounding error.

This lesson compares int4, int8, fp8 (e4m3 and e5m2), fp16 and bf16 on the weights and activations of a real
model (MiniLM) and on a digits CNN's outputs. Everything is measured with the package
(`wb.quant.primitives` for the quantizers, `wb.teach.formats` for the figures). Four exercises along the way:
replace each `...` and run the cell; the box under it says what was expected and what you gave."""),
    new_code_cell("""# Parameters (papermill replaces these values; the regression run sets solutions = True)
solutions = False                            # True fills in the exercises
layer = "encoder.layer.0.output.dense"       # the MiniLM layer whose weights and inputs we store in each format
calibration_samples = 8                      # sentences whose activations at `layer` are recorded
digits_samples = 512                         # held-out digits images for the CNN's logits
threads = 1                                  # CPU threads (small tensor ops run best on one thread)""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import math

import pandas as pd
import torch

import workbench as wb

torch.set_num_threads(threads)
F = wb.teach.formats"""),
    new_markdown_cell("""## 1. The real tensors

`w` is the weight of one MiniLM layer and `a` its inputs (activations after the GELU) on real sentences from
the task's calibration split. Their magnitudes span several orders of magnitude, and `a` has a few large
outliers - keep both facts in mind."""),
    new_code_cell("""model = wb.models.load("minilm")
task = wb.tasks.load("minilm")
w = model.get_submodule(layer).weight.detach()                                   # (out, in)
a = torch.cat(F.layer_inputs(model, layer, task.calibration(calibration_samples), mask_index=1))  # (tokens, in)
pd.DataFrame({f"{name} {tuple(t.shape)}": {"max |x|": float(t.abs().max()), "median |x|": float(t.abs().median()),
                                           "smallest |x| > 0": float(t.abs()[t != 0].min())}
              for name, t in {"weights w": w, "activations a": a}.items()}).T"""),
    new_markdown_cell("""## 2. Floats: sign, exponent, mantissa

A float format with *e* exponent bits and *m* mantissa bits stores a sign *s*, an exponent field *E* and a
mantissa field *M*. With bias = 2^(e-1) - 1:

```
normal    (E > 0):   x = (-1)^s · 2^(E - bias) · (1 + M / 2^m)
subnormal (E = 0):   x = (-1)^s · 2^(1 - bias) · (M / 2^m)
```

The exponent bits buy **range** (each one doubles the number of powers of two), the mantissa bits buy
**precision**: between two powers of two there are 2^m evenly spaced values, so the relative step is about
2^-m everywhere in the range. An **integer** format has no exponent: *b* bits give the codes
-2^(b-1) ... 2^(b-1) - 1, and a *scale* turns them into values, x ≈ q · scale - the same absolute step everywhere.

The table below is computed from PyTorch's dtypes (integers for scale 1)."""),
    new_code_cell("""F.format_table()"""),
    new_markdown_cell("""How a few numbers are stored (`F.bit_layout` rounds the value into the format and splits the bits as
sign / exponent / mantissa):"""),
    new_code_cell("""pd.DataFrame([F.bit_layout(v, f) for v, f in [(1.0, "e4m3"), (0.3, "e4m3"), (0.001, "e4m3"), (0.3, "e5m2"),
                                            (0.3, "fp16"), (0.3, "bf16"), (70000.0, "bf16")]])"""),
    new_markdown_cell("""### Exercise 1 · the largest e4m3 value

The fp8 format PyTorch implements is **e4m3fn** ("finite"): it has no infinities, so the top exponent field
1111 holds ordinary numbers - except the one pattern S.1111.111, which is NaN. The bias is 7. What is the
largest finite value?"""),
    new_code_cell("""# Exercise 1 - the largest finite e4m3 value. Replace ... with a number or an expression.
answer = ...
answer = 2 ** (15 - 7) * (1 + 6 / 8) if solutions else answer
F.check_e4m3_max(answer)"""),
    new_markdown_cell("""## 3. The grids

With a scale, only the *shape* of a grid matters, so below every grid is scaled so that its largest value is 1,
next to the distribution of |w| / max|w|. Integer grids are uniform: they put most of their values near the
maximum, where few weights are. Float grids are logarithmic: the same number of values in every power of two,
down to their smallest subnormal."""),
    new_code_cell("""F.grid_figure(("int4", "int8", "e4m3", "e5m2"), x=w, x_label="w").show()"""),
    new_markdown_cell("""The same in each format's own units: the **relative step** (gap to the next value, divided by the value)
against magnitude. Floats keep a saw-tooth band around 2^-m over their whole range and degrade only in the
subnormals at the bottom; an integer's relative step is 1 / q, large for small values. bf16's band continues
far beyond the plot (down to 1e-40, up to 3e38): zoom out."""),
    new_code_cell("""F.spacing_figure(("int8", "e4m3", "e5m2", "fp16", "bf16")).show()"""),
    new_markdown_cell("""## 4. Round-trip error on real tensors

Low-bit formats are used **with a scale**: a per-tensor scale maps max|x| to the format's largest value, and
values are rounded to the grid. For symmetric int8 the workbench follows PyTorch:

```
scale = max|x| / ((qmax - qmin) / 2)          qmin = -128, qmax = 127
q     = clamp(round(x / scale), qmin, qmax)    x_hat = q · scale
```

(some libraries use the restricted range -127 ... 127 and divide by 127 instead).

### Exercise 2 · the int8 scale of the weights"""),
    new_code_cell("""# Exercise 2 - the scale of symmetric per-tensor int8 for the weights w. Replace ... with your code.
answer = ...
answer = w.abs().max() / ((127 - (-128)) / 2) if solutions else answer
F.check_int8_scale(answer, w)"""),
    new_markdown_cell("""Now every format on both tensors (`F.error_table` calls `wb.quant.primitives.fake_quantize` for the
integers, `float8_quantize` / `float8_dequantize` for fp8, a plain cast for fp16 / bf16). The error is the
signal-to-quantization-noise ratio, `SQNR = 20 · log10(‖x‖ / ‖x - x_hat‖)` dB,
where each extra mantissa or integer bit is worth about 6 dB. Compare fp8 with int8 on these heavy-tailed
tensors, and look at the `flushed` column (the fraction of non-zero values rounded to 0): one large value sets
the int8 scale and the small values fall below half a step, while fp8's logarithmic grid keeps them. Lesson 11
fixes the integer case with finer scales (per channel, per group)."""),
    new_code_cell("""errors = F.error_table({"weights": w, "activations": a})
F.error_bars_figure(errors).show()
errors.pivot(index="format", columns="tensor", values=["sqnr_db", "flushed"]).round(4)"""),
    new_markdown_cell("""## 5. Range vs precision without a scale: fp16 and bf16

fp16 and bf16 are usually used *without* a scale, so their range matters. Both have 16 bits; fp16 spends them
on precision (5 exponent, 10 mantissa bits), bf16 on range (8 exponent bits, like fp32, and 7 mantissa bits).
The figure shows the worst relative error of a plain cast at each magnitude (1 = the value is lost: flushed to 0
or overflowed), above the magnitudes of real tensors: the MiniLM weights, and a digits CNN's output
probabilities and exp(logits), the two halves of a softmax."""),
    new_code_cell("""cnn = wb.models.load("digits-cnn")
digits = wb.tasks.load("digits")
with torch.inference_mode():
    z = cnn(*digits.example_inputs(digits_samples))       # (samples, 10) logits on held-out images
p = z.softmax(dim=-1)                                      # class probabilities: many are tiny
F.magnitude_error_figure(("e4m3", "e5m2", "fp16", "bf16"),
                         tensors={"MiniLM w": w, "CNN probabilities": p, "CNN exp(logits)": torch.exp(z)}).show()"""),
    new_markdown_cell("""### Exercise 3 · which format loses the small probabilities?

Cast `p` directly (no scale) to fp16 and to bf16. Which of the two turns some of its non-zero values into 0?
Count rather than guess: a value is lost when it is non-zero in fp32 and zero after the cast."""),
    new_code_cell("""# Exercise 3 - answer "fp16" or "bf16".
answer = ...
answer = (("fp16" if int(((p.half() == 0) & (p != 0)).sum()) > int(((p.bfloat16() == 0) & (p != 0)).sum())
           else "bf16") if solutions else answer)
F.check_loses_small_values(answer, p)"""),
    new_markdown_cell("""### Exercise 4 · when does exp() overflow in fp16?

A softmax computed naively, exp(z) / Σ exp(z), needs exp(z) to fit. What is the largest logit *z* for which
exp(z) is still finite in fp16? (The largest fp16 value is in the table of section 2.)"""),
    new_code_cell("""# Exercise 4 - the largest x with a finite exp(x) in fp16. Replace ... with a number or an expression.
answer = ...
answer = math.log(torch.finfo(torch.float16).max) if solutions else answer
F.check_fp16_exp_limit(answer)"""),
    new_markdown_cell("""Measured on the CNN: the fraction of values each format flushes to 0 and the fraction that overflows, for a
plain cast. (PyTorch saturates e4m3 at 448 instead of producing inf; that is counted as an overflow too.)"""),
    new_code_cell("""casts = F.error_table({"probabilities": p, "exp(logits)": torch.exp(z)}, ("fp16", "bf16", "e5m2", "e4m3"),
                      scaled=False)
casts.pivot(index="format", columns="tensor", values=["flushed", "overflowed"]).round(4)"""),
    new_markdown_cell("""### Why bf16 keeps fp32's range

bf16 is fp32 with its 16 low mantissa bits rounded away: same sign bit, same 8 exponent bits, 7 of the 23
mantissa bits. So any fp32 number (up to ~3.4e38, down to ~1e-38 as a normal number) stays in range; only its
precision drops to 2^-8 relative. fp16 has a different, narrower exponent, so it must be *rescaled* to fit
(mixed-precision training's loss scaling). Checked on the weights: the bf16 bit pattern equals the top half of
the fp32 bit pattern, or exceeds it by one when the discarded half rounds up."""),
    new_code_cell("""top_half = (w.contiguous().view(torch.int32) >> 16).flatten()                  # sign, exponent, 7 mantissa bits
bf16_bits = (w.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).flatten()
difference = (bf16_bits - (top_half & 0xFFFF)).unique().tolist()
print("bf16 bits - top 16 bits of fp32:", difference, "(0: truncation, 1: rounded up)")"""),
    new_markdown_cell("""## Summary

- A format is a grid. Integers: uniform (absolute step = the scale); floats: logarithmic (relative step
  2^-m) between the smallest subnormal and the largest value.
- **Range** comes from exponent bits, **precision** from mantissa bits. With a per-tensor scale, fp8's
  logarithmic grid suits heavy-tailed tensors; without a scale, range decides: fp16 flushes tiny probabilities
  and overflows exp(12), bf16 does neither, at 3 bits less precision.
- Next lesson (11): how the scale is chosen - per tensor, per channel, per group - and how clipping and
  calibration pick the range of activations.

The values below are recorded in the notebook's outputs; the regression suite compares them with
`data/golden/10_number_formats.json`."""),
    new_code_cell("""sqnr = errors.set_index(["tensor", "format"])["sqnr_db"]
lost = casts.set_index(["tensor", "format"])
done = wb.teach.summary()
wb.reports.record(
    **{f"weights_{f}_sqnr_db": sqnr["weights", f] for f in ("int4", "int8", "e4m3", "e5m2", "fp16", "bf16")},
    **{f"activations_{f}_sqnr_db": sqnr["activations", f] for f in ("int4", "int8", "e4m3", "e5m2", "fp16", "bf16")},
    weights_int8_flushed=float(errors.set_index(["tensor", "format"])["flushed"]["weights", "int8"]),
    probabilities_fp16_flushed=float(lost.loc[("probabilities", "fp16"), "flushed"]),
    probabilities_bf16_flushed=float(lost.loc[("probabilities", "bf16"), "flushed"]),
    exp_logits_fp16_overflowed=float(lost.loc[("exp(logits)", "fp16"), "overflowed"]),
    exp_logits_bf16_overflowed=float(lost.loc[("exp(logits)", "bf16"), "overflowed"]),
    bf16_is_top_half_of_fp32=set(difference) <= {0, 1},
    e4m3_max=float(torch.finfo(torch.float8_e4m3fn).max),
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("10_number_formats", cells)
