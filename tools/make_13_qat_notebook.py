"""Write notebooks/13_qat.ipynb from the cells below (run after editing them):

    cd tools && ../.venv/bin/python make_13_qat_notebook.py
"""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# 13 · Quantization-aware training: fake quantization and the straight-through estimator

Post-training quantization rounds a finished model. At 2 bits that can cost a lot of accuracy, and no choice of
rounding alone wins it back. **Quantization-aware training (QAT)** lets the weights adapt to the grid: every
forward pass uses *fake-quantized* weights — rounded to the grid, but kept in floating point —

$$\\hat w = s \\cdot \\operatorname{clamp}\\big(\\operatorname{round}(w / s),\\; q_{\\min},\\; q_{\\max}\\big),
\\qquad [q_{\\min}, q_{\\max}] = [-2^{b-1},\\, 2^{b-1}-1]$$

and the loss is backpropagated to the float weights $w$. One problem: $\\operatorname{round}$ has derivative 0
almost everywhere, so no gradient would ever reach $w$. The **straight-through estimator (STE)** pretends
round() is the identity in the backward pass:

$$\\frac{\\partial \\hat w}{\\partial w} \\approx \\begin{cases} 1 & q_{\\min} \\le \\operatorname{round}(w/s) \\le q_{\\max} \\\\
0 & \\text{otherwise (clamped)} \\end{cases}$$

With **learned step sizes (LSQ)** the scale $s$ is a parameter too, trained by the same loss. After training,
`wb.qat.convert` stores exactly the grid the model was trained on, as real low-bit modules.

Exercises are marked **Exercise**: replace the `...`, run the cell, read the feedback."""),
    new_code_cell("""# Parameters (papermill replaces these values when the notebook runs as a report or a regression test)
solutions = False              # True fills in every exercise (the regression run)
model_name = "digits-cnn"      # a zoo model with Conv2d / Linear layers
task_name = "digits"
patterns = ["conv*", "fc*"]    # the layers to quantize: every convolution and Linear
bits = 2                       # weight bits (per output channel, symmetric)
epochs = 3                     # QAT fine-tuning epochs
lr = 1e-3
bits_list = [2, 3, 4]          # the bit widths of the PTQ vs QAT comparison
threads = 1                    # CPU threads: 1 is robust on a shared machine, 2 faster on an idle one""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb

torch.set_num_threads(threads)
T = wb.teach.qat                     # this lesson's figures, helpers and exercise checks
wb.teach.reset()"""),
    new_markdown_cell("""## 1. Fake quantization, forward and backward

A 2-bit signed grid with scale 0.5 has four values: −1, −0.5, 0, 0.5. The figure shows what the forward pass
computes and what gradient the backward pass sends back (autograd through the package's
`fake_quantize_ste`, the function every QAT layer uses)."""),
    new_code_cell("""curve = T.ste_curve(bits=2, scale=0.5)
T.ste_figure(curve, bits=2, scale=0.5).show()"""),
    new_markdown_cell("""Inside the grid the gradient is 1, as if there were no rounding. In the shaded regions the code was clamped:
moving $w$ a little does not change $\\hat w$ at all, so those weights get **no gradient** — the clamp's
derivative is honest, only round()'s is faked. Note the asymmetry of a signed grid: codes run from −2 to +1.

### Exercise 1 — predict the fake-quantized values

For `x` below, 2 bits (`qmin = -2`, `qmax = 1`) and scale 0.5: what does fake quantization return?"""),
    new_code_cell("""x = torch.tensor([-1.3, -0.6, -0.2, 0.1, 0.3, 0.7, 1.2])
scale, qmin, qmax = 0.5, -2, 1
# Exercise 1 - replace ... with the fake-quantized values (a tensor like x)
answer = ...
answer = (x / scale).round().clamp(qmin, qmax) * scale if solutions else answer
T.check_fake_quantize(answer, x, scale, bits=2)"""),
    new_markdown_cell("""### Exercise 2 — the STE gradient

Now the gradient of `fake_quantize(x).sum()` with respect to each value of `x`, under the straight-through
estimator: a tensor of 0s and 1s. Which values get zero gradient — and why is 0.7 not one of them?"""),
    new_code_cell("""# Exercise 2 - replace ... with d sum(fake_quantize(x)) / dx (a tensor like x)
answer = ...
answer = ((x / scale).round() >= qmin).float() * ((x / scale).round() <= qmax).float() if solutions else answer
T.check_ste_gradient(answer, x, scale, bits=2)"""),
    new_markdown_cell("""## 2. A real model at 2 bits: PTQ, then QAT

The digits CNN (three conv + BatchNorm blocks, two Linear layers) with **every** convolution and Linear stored
at `bits` bits, one scale per output channel. First round-to-nearest (PTQ), measured on the test split:"""),
    new_code_cell("""model = wb.models.load(model_name)
task = wb.tasks.load(task_name)
plan = T.qat_plan(patterns, bits)
fp32_accuracy = task.evaluate(model)["accuracy"]
ptq_model = wb.apply(model, plan, progress=False)
ptq_accuracy = task.evaluate(ptq_model)["accuracy"]
size_ratio = wb.size_bytes(ptq_model) / wb.size_bytes(model)
print(f"fp32 {fp32_accuracy:.4f}  ->  PTQ int{bits} {ptq_accuracy:.4f}   (size {size_ratio:.3f}x of fp32)")
plan.describe(model)"""),
    new_markdown_cell("""Now QAT: `wb.qat.prepare` puts fake quantization on the same layers (a copy; the model is untouched), we
fine-tune for a few epochs with the usual training loop (`T.train_with_curve` is `wb.training.fit_classifier`
plus a recorded curve), and `wb.qat.convert` turns the result into the same real int modules as PTQ. We train
twice: with min-max scales (STE only) and with learned scales (LSQ). The test accuracy is plotted during
training only to show the curve — the number of epochs was fixed in advance, nothing is chosen by it."""),
    new_code_cell("""qat_model = wb.qat.prepare(model, plan)
qat_curve = T.train_with_curve(qat_model, task, epochs=epochs, lr=lr, label="QAT (STE)")
lsq_model = wb.qat.prepare(model, plan, learnable_scales=True)
lsq_curve = T.train_with_curve(lsq_model, task, epochs=epochs, lr=lr, label="QAT + LSQ")
qat_real, lsq_real = wb.qat.convert(qat_model), wb.qat.convert(lsq_model)
qat_accuracy = task.evaluate(qat_real)["accuracy"]
lsq_accuracy = task.evaluate(lsq_real)["accuracy"]
print(f"fp32 {fp32_accuracy:.4f}   PTQ {ptq_accuracy:.4f}   QAT {qat_accuracy:.4f}   QAT + LSQ {lsq_accuracy:.4f}")
print("converted size equals PTQ's:", wb.size_bytes(qat_real) == wb.size_bytes(ptq_model))
T.curves_figure([qat_curve, lsq_curve], fp32_accuracy, ptq_accuracy).show()"""),
    new_markdown_cell("""The curves start at PTQ's accuracy — step 0 *is* the PTQ model, since the fake-quantized forward pass and
the converted int modules compute the same numbers — and climb back within an epoch or two. The converted
models cost exactly the bytes of the PTQ model: QAT changes which weights are stored, not how.

### Exercise 3 — how much did QAT recover?

What fraction of the accuracy PTQ lost did QAT (STE) win back? Use the measured `fp32_accuracy`,
`ptq_accuracy` and `qat_accuracy`."""),
    new_code_cell("""# Exercise 3 - replace ... with the recovered fraction (a number; 1.0 = everything PTQ lost)
answer = ...
answer = (qat_accuracy - ptq_accuracy) / (fp32_accuracy - ptq_accuracy) if solutions else answer
T.check_recovered(answer, fp32_accuracy, ptq_accuracy, qat_accuracy)"""),
    new_markdown_cell("""## 3. What LSQ learned

With min-max scales the largest weight of each channel sets the step, so at 2 bits most weights share just two
or three values. LSQ learns each channel's step from the loss: a smaller step clips the extremes (they land in
the clamped region and stop getting gradients) but resolves the bulk of the weights more finely."""),
    new_code_cell("""layer = "conv2"
scales = T.lsq_scales(lsq_model.get_submodule(layer))
zero_grad_qat = T.zero_gradient_fraction(qat_model.get_submodule(layer))
zero_grad_lsq = T.zero_gradient_fraction(lsq_model.get_submodule(layer))
print(f"{layer}: weights with zero gradient (clamped): QAT {zero_grad_qat:.1%}, QAT + LSQ {zero_grad_lsq:.1%}")
T.lsq_scales_figure(scales).show()"""),
    new_markdown_cell("""## 4. When is QAT worth it?

The same comparison at every bit width in `bits_list`: PTQ, QAT and QAT + LSQ, each fine-tuned for `epochs`
epochs and converted to real modules."""),
    new_code_cell("""by_bits = T.ptq_vs_qat(model, task, patterns, bits_list, epochs=epochs, lr=lr)
T.bits_figure(by_bits).show()
by_bits"""),
    new_markdown_cell("""At 4 and often 3 bits per channel, round-to-nearest already keeps this model's accuracy, and QAT has little
to add; at 2 bits PTQ falls apart and a few epochs of QAT bring it back. QAT costs a training run (and the
training data), so try PTQ first and reach for QAT when the bit width is too low for it.

## Summary

- Fake quantization rounds and clamps in the forward pass; the STE passes gradients through round() unchanged
  and blocks them where values were clamped.
- QAT starts from the PTQ model and trains the weights to live on the grid; `wb.qat.convert` stores exactly
  that grid, so the real int model computes what was trained.
- LSQ also learns the step size: smaller steps, more clipping, finer resolution where the weights are.

The values below are recorded in the notebook's outputs; the regression suite compares them with
`data/golden/13_qat.json`."""),
    new_code_cell("""done = wb.teach.summary()
results = {int(r["bits"]): r for _, r in by_bits.iterrows()}
wb.reports.record(
    model=model_name,
    bits=bits,
    fp32_accuracy=fp32_accuracy,
    ptq_accuracy=ptq_accuracy,
    qat_accuracy=qat_accuracy,
    lsq_accuracy=lsq_accuracy,
    recovered=(qat_accuracy - ptq_accuracy) / (fp32_accuracy - ptq_accuracy),
    size_ratio=size_ratio,
    qat_first_accuracy=qat_curve.accuracy[0],
    zero_grad_qat=zero_grad_qat,
    zero_grad_lsq=zero_grad_lsq,
    **{f"{k}_int{b}": float(r[k]) for b, r in results.items() for k in ("ptq", "qat", "lsq")},
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("13_qat", cells)
