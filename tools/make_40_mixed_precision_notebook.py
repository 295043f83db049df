"""Write notebooks/40_mixed_precision.ipynb (the mixed-precision lesson) from the cells below; run after editing
them: ``cd tools && ../.venv/bin/python make_40_mixed_precision_notebook.py``."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Mixed precision: autocast, loss scaling, and what 16 bits buy on this CPU

Storing and computing in 16-bit floats halves the bytes of weights and activations and - where the hardware has
the instructions - speeds up matrix multiplications. Two 16-bit formats split their bits differently:

| format | exponent bits | mantissa bits | largest | smallest normal | smallest subnormal |
|---|---|---|---|---|---|
| fp32 | 8 | 23 | 3.4e38 | $2^{-126}$ | $2^{-149}$ |
| bf16 | 8 | 7 | 3.4e38 | $2^{-126}$ | $2^{-133}$ |
| fp16 | 5 | 10 | 65504 | $2^{-14}$ | $2^{-24} \\approx 5.96\\times10^{-8}$ |

bf16 keeps fp32's **range** and gives up precision; fp16 keeps more precision in a narrow range, so tiny
gradients **underflow** to zero. *Mixed* precision keeps fp32 where it matters (the master weights, the optimizer,
reductions such as LayerNorm and the loss) and runs the big matmuls in 16 bits. For fp16 training it adds **loss
scaling**: multiply the loss by $S$, so every gradient is $S$ times larger during the backward pass, then divide
the gradients by $S$ in fp32 before the update:

$$\\nabla_\\theta (S\\,L) = S\\,\\nabla_\\theta L
    \\qquad\\Rightarrow\\qquad g = \\tfrac{1}{S}\\,\\nabla_\\theta (S\\,L)$$

You will see which layers autocast runs in which dtype, measure how many of a real model's gradients fp16 would
lose with and without scaling, watch a GradScaler adapt $S$, and measure fp32 / bf16 / fp16 on this CPU.
Exercises are marked **Exercise**: replace `...` with your code and run the cell."""),
    new_code_cell("""# Parameters (papermill replaces these values; solutions=True fills in the exercises)
solutions = False
model_name = "tiny-lm"          # the real model of the autocast, gradient and inference sections
layer = "h.0.mlp.c_fc"          # the layer of exercise 1
batch_size = 8                  # batch of the gradient pass and the latency measurements
quick = True                    # True: perplexity on the task's quick subset, fewer timing runs
train_epochs = 2                # epochs of the digits CNN trained in fp32 / bf16 / fp16 (section 4)
threads = 1                     # CPU threads for training and every measurement""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import math

import torch

import workbench as wb

torch.set_num_threads(threads)   # one thread: steady timings on a shared machine
model = wb.models.load(model_name)
task = wb.tasks.load(model_name)
wb.teach.precision.format_table()"""),
    new_markdown_cell("""## 1. What autocast does

Inside `torch.autocast(device, dtype)` the weights stay fp32. Operations on the lower-precision list (linear
layers, convolutions, matmuls) cast their inputs - and the weights, on every call - to the 16-bit dtype and
compute there; a few that need range (the losses, e.g. cross-entropy) are forced to fp32; everything else runs
in the dtype of its inputs. So in this pre-LayerNorm transformer the residual stream stays fp32 (the embeddings
are fp32, and bf16 + fp32 gives fp32) and the LayerNorms run in fp32, while every Linear outputs bf16. Below,
one forward pass under bf16 autocast, one row per distinct (layer type, input, output) combination."""),
    new_code_cell("""tokens = task.calibration(batch_size)[0][0]          # (batch, 128) characters of training text
table = wb.teach.precision.autocast_table(model, (tokens,), torch.bfloat16)
table.drop_duplicates(["type", "input", "output"])"""),
    new_markdown_cell("""**Exercise 1.** Casting a layer's weights to bf16 (`wb.precision.Cast`) stores each parameter
in 2 bytes instead of 4. How many bytes does it save on `layer` (weight and bias)?"""),
    new_code_cell("""linear = model.get_submodule(layer)
print(layer, linear)
# Exercise 1 - bytes saved by storing `linear` in bf16. Replace ... with your code.
answer = ...
answer = sum(p.numel() for p in linear.parameters()) * 2 if solutions else answer
wb.teach.precision.check_bytes_saved(answer, linear, torch.bfloat16)"""),
    new_code_cell("""one_layer = wb.apply(model, {layer: wb.precision.Cast(torch.bfloat16)})
bytes_saved = wb.size_bytes(model) - wb.size_bytes(one_layer)
print(f"measured: {wb.size_bytes(model):,} -> {wb.size_bytes(one_layer):,} bytes, {bytes_saved:,} saved")"""),
    new_markdown_cell("""## 2. Why fp16 gradients underflow

One fp32 forward and backward pass of the trained model on real text. The *activation* gradients - what
flows back through every layer, and what an fp16 backward pass stores in fp16 - are far smaller than the
weights: a trained model's loss is small and averaged over thousands of tokens. Everything in the red zone
would become exactly 0 in fp16; the orange zone survives as subnormals with fewer significant bits. Scaling the
loss by $2^{16}$ shifts the whole histogram 16 steps to the right. (The weights' own gradients are accumulated in
fp32 under autocast, because the master weights are fp32: it is the activation gradients that fp16 threatens.)"""),
    new_code_cell("""grads = wb.teach.precision.gradient_magnitudes(model, tokens[:, :-1], tokens[:, 1:])
wb.teach.precision.gradient_histogram(grads, scale=2.0 ** 16).show()"""),
    new_code_cell("""activations = grads["activations"]
wb.teach.precision.scale_table(activations)"""),
    new_markdown_cell("""**Exercise 2.** `value` is the median magnitude of these activation gradients. Does it become 0
when stored in fp16? Answer `True` or `False` (you can compute it, or reason with the table at the top)."""),
    new_code_cell("""nonzero = activations[activations > 0]
value = float(nonzero.median())
print(f"value = {value:.3g}")
# Exercise 2 - True if `value` underflows to 0 in fp16. Replace ... with your code.
answer = ...
answer = bool(torch.tensor(value).half() == 0) if solutions else answer
wb.teach.precision.check_underflows(answer, value, torch.float16)"""),
    new_markdown_cell("""**Exercise 3.** `small` is the 1st percentile of the non-zero activation gradients. Find the
smallest power of two $S$ such that $S \\times$ `small` reaches fp16's smallest *normal* value $2^{-14}$ (so it keeps
full precision). (The largest gradient times $S$ must also stay below 65504: check it in the cell after.)"""),
    new_code_cell("""small = float(nonzero.kthvalue(nonzero.numel() // 100).values)
print(f"small = {small:.3g}")
# Exercise 3 - the smallest power of two S with S * small >= 2**-14. Replace ... with your code.
answer = ...
answer = 2.0 ** math.ceil(math.log2(2 ** -14 / small)) if solutions else answer
wb.teach.precision.check_loss_scale(answer, small)"""),
    new_code_cell("""needed = 2.0 ** math.ceil(math.log2(2 ** -14 / small))
print(f"S = 2^{math.log2(needed):.0f}: the largest gradient x S = {float(activations.max()) * needed:.3g} "
      f"(fp16 overflows above 65504)")"""),
    new_markdown_cell("""## 3. Dynamic loss scaling (GradScaler)

The right $S$ changes during training, so `torch.amp.GradScaler` adapts it: a step whose gradients contain
inf/NaN is **skipped** and $S$ is halved; after `growth_interval` good steps in a row $S$ doubles. Below, the
trained digits MLP is trained on for 40 steps with fp16 autocast through `wb.precision.AmpStep`, starting from
a deliberately large $S = 2^{24}$ and doubling after 10 good steps (PyTorch's defaults: $2^{16}$ and 2000)."""),
    new_code_cell("""mlp = wb.models.load("digits-mlp")
trace = wb.teach.precision.scale_trace(mlp, wb.tasks.load("digits"), steps=40, init_scale=2.0 ** 24,
                                       growth_interval=10)
wb.teach.precision.scale_trace_figure(trace).show()"""),
    new_markdown_cell("""## 4. Speed, memory and accuracy on this CPU

### Inference

The same model four ways, measured side by side with `wb.measure` (quality on the task, median latency at a
fixed thread count, bytes of the weights, peak memory of a forward pass): fp32; weights stored and computed in
bf16 (`wb.precision.Cast`); the same in fp16; and fp32 weights under bf16 autocast."""),
    new_code_cell("""variants = {
    "fp32": model,
    "bf16 weights": wb.apply(model, {"*": wb.precision.Cast(torch.bfloat16)}),
    "fp16 weights": wb.apply(model, {"*": wb.precision.Cast(torch.float16)}),
    "bf16 autocast": wb.teach.precision.Autocast(model, torch.bfloat16),
}
measured = [wb.measure(m, task, batch_size=batch_size, quick=quick, threads=threads, name=label)
            for label, m in variants.items()]
wb.compare(*measured, labels=list(variants))"""),
    new_code_cell("""wb.plots.comparison_bars(measured, labels=list(variants)).show()"""),
    new_markdown_cell("""This CPU (AVX-512 with BF16 instructions) has fast bf16 matmul kernels but no fp16 arithmetic,
so fp16 is *emulated* and much slower, though it halves the bytes just the same. Perplexity barely moves: inference
of a trained model tolerates 16-bit weights well. Autocast keeps fp32 weights (no bytes saved) and pays to cast
them on every call. On a GPU with tensor cores both 16-bit formats are fast.

### Training

A fresh digits CNN trained the same way (same seed, AdamW, one-cycle) in fp32, with bf16 autocast, and with fp16
autocast plus a GradScaler, by `wb.precision.compare_precisions`: median step time, peak memory of a training
step, skipped steps and the final test accuracy."""),
    new_code_cell("""torch.manual_seed(0)
fresh = wb.models.architectures.DigitsCNN()
training = wb.precision.compare_precisions(fresh, wb.tasks.load("digits"), epochs=train_epochs, threads=threads)
training"""),
    new_markdown_cell("""All three reach the same accuracy from the same seed. bf16 autocast steps faster and holds less memory
(16-bit activations are kept for the backward pass); fp16 pays for the missing fp16 arithmetic on this CPU, and
its GradScaler, starting at $2^{16}$, skipped no step: once the loss is scaled, these gradients fit in fp16's
range."""),
    new_markdown_cell("""## Summary

The values below are recorded in the notebook's outputs; the regression suite reads them back."""),
    new_code_cell("""done = wb.teach.summary()
by = training.set_index("precision")
wb.reports.record(
    bytes_saved_bf16_layer=bytes_saved,
    underflow_scale_1=wb.teach.precision.underflow_fraction(activations, torch.float16, 1.0),
    underflow_scale_2_16=wb.teach.precision.underflow_fraction(activations, torch.float16, 2.0 ** 16),
    loss_scale_needed=needed,
    skipped_steps_from_2_24=int(trace["skipped"].sum()),
    fp32_perplexity=measured[0].primary_value,
    bf16_perplexity=measured[1].primary_value,
    fp16_perplexity=measured[2].primary_value,
    autocast_perplexity=measured[3].primary_value,
    bf16_size_ratio=measured[1].size_bytes / measured[0].size_bytes,
    bf16_speedup=measured[0].latency_ms / measured[1].latency_ms,
    fp16_speedup=measured[0].latency_ms / measured[2].latency_ms,
    train_fp32_accuracy=by.loc["fp32", "accuracy"],
    train_bf16_accuracy=by.loc["bf16", "accuracy"],
    train_fp16_accuracy=by.loc["fp16", "accuracy"],
    train_fp16_skipped=int(by.loc["fp16", "skipped_steps"]),
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("40_mixed_precision", cells)
