"""Write notebooks/20_pruning.ipynb (the pruning lesson) from the cells below; run after editing them:
``cd tools && ../.venv/bin/python make_20_pruning_notebook.py``."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Pruning: which weights to drop, what it costs, what it buys

Pruning sets weights to zero. Its **sparsity** is the fraction it removes:

$$s = \\frac{\\#\\text{pruned weights}}{\\#\\text{weights}} = 1 - \\frac{\\text{mask.sum()}}{\\text{mask.numel()}}$$

(a mask is `True` where a weight is **kept**). *Which* weights go decides two things:

| kind | removes | accuracy | speed with dense kernels |
|---|---|---|---|
| unstructured magnitude | the smallest $|w|$, anywhere | best at a given sparsity | **none**: zeros still multiplied |
| structured (channels) | whole output rows / channels, smallest L1 norm | worse | **real**: the layers get smaller |
| N:M (2:4) | the $M-N$ smallest of every $M$ consecutive weights | in between | needs sparse tensor cores (GPU) |

You will draw the three masks on a real layer, prune the digits CNN from 0 to 95 % and watch its accuracy fall,
recover most of it with a short fine-tune, and time structured against unstructured pruning on this CPU.
Exercises are marked **Exercise**: replace `...` with your code and run the cell; the check tells you what it
expected and what it found."""),
    new_code_cell("""# Parameters (papermill replaces these values; solutions=True fills in the exercises)
solutions = False
model_name = "digits-cnn"                      # a digits model from wb.models
layer = "fc1"                                  # the Linear layer whose masks are drawn
patterns = ["conv*", "fc1"]                    # layers to prune (the classifier fc2 stays dense)
sparsities = [0.0, 0.5, 0.7, 0.8, 0.9, 0.95]   # the sweep
finetune_epochs = 3                            # the short fine-tune after pruning
finetune_lr = 5e-3
amount = 0.5                                   # fraction removed in the speed comparison
batch_size = 256                               # batch for the latency measurements
threads = 1                                    # CPU threads for training and every latency measurement""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb

torch.set_num_threads(threads)   # small models train fastest on one thread, and a shared machine stays usable
model = wb.models.load(model_name)
task = wb.tasks.load("digits")
dense_accuracy = task.evaluate(model)["accuracy"]
print(f"{model_name}: test accuracy {dense_accuracy:.4f}")
wb.layer_table(model)"""),
    new_markdown_cell("""## 1. Three masks on one real layer

Below, each mask prunes 50 % of the weights of the CNN's first Linear layer (a corner of it is drawn; blank =
pruned). Magnitude pruning leaves a scatter, structured pruning empties whole rows (those neurons disappear,
and so do the matching inputs of the next layer), and 2:4 keeps exactly two of every four neighbours along
each row."""),
    new_code_cell("""weight = model.get_submodule(layer).weight.detach()
masks = wb.teach.pruning.lesson_masks(weight, sparsity=0.5)
wb.teach.pruning.mask_heatmaps(weight, masks, layer=layer).show()"""),
    new_markdown_cell("""### Global thresholds

Pruning every layer by the same fraction ignores that layers differ. A **global** magnitude threshold ranks
the weights of all selected layers together, so layers full of small weights lose more.
`wb.prune.global_plan` turns one global sparsity into per-layer sparsities."""),
    new_code_cell("""plan = wb.prune.global_plan(model, patterns, 0.7)
pruned = wb.apply(model, plan)
wb.prune.sparsity_of(pruned)"""),
    new_markdown_cell("""**Exercise 1.** `conv1_mask` is the keep-mask the global plan gave `conv1` (True = kept).
What is its sparsity, as a fraction between 0 and 1?"""),
    new_code_cell("""conv1_mask = pruned.conv1.mask
# Exercise 1 - the sparsity of conv1_mask. Replace ... with your code.
answer = ...
answer = 1 - conv1_mask.float().mean() if solutions else answer
wb.teach.pruning.check_sparsity(answer, conv1_mask)"""),
    new_markdown_cell("""**Exercise 2.** 2:4 pruning works on groups of 4 consecutive weights along the input dimension
(for a convolution: its `in_channels x kh x kw` inputs per output channel). How many of `conv2`'s weights does
it keep? Compute it from the weight's shape; the cell after the check builds the real mask."""),
    new_code_cell("""w2 = model.conv2.weight
print("conv2 weight:", tuple(w2.shape))
# Exercise 2 - the number of weights 2:4 keeps in conv2. Replace ... with your code.
answer = ...
answer = w2.numel() // 4 * 2 if solutions else answer
wb.teach.pruning.check_nm_kept(answer, w2, n=2, m=4)"""),
    new_code_cell("""semi = wb.apply(model, {"conv2": wb.prune.NM(n=2, m=4)})
nm_kept = int(semi.conv2.mask.sum())
print(f"2:4 keeps {nm_kept} of {w2.numel()} weights; accuracy {task.evaluate(semi)['accuracy']:.4f} "
      f"(pruning conv2 alone, no fine-tune)")"""),
    new_markdown_cell("""## 2. Accuracy against sparsity, and the fine-tune that recovers it

`wb.prune.sweep` prunes the selected layers at each sparsity (per layer, smallest $|w|$ first), measures test
accuracy, and - with `finetune_epochs` - trains the pruned model for a few epochs with the masks kept (pruned
weights get no gradient, so they stay zero). Random pruning at the same sparsities is the baseline every
criterion must beat.

Watch for two things: without the fine-tune, accuracy collapses well before the weights run out (the layers'
outputs shift, and BatchNorm's running statistics no longer match them); a few epochs of training move the
surviving weights to compensate, until too few are left."""),
    new_code_cell("""sweep = wb.prune.sweep(model, task, patterns, sparsities, finetune_epochs=finetune_epochs,
                       lr=finetune_lr)
random = wb.prune.sweep(model, task, patterns, sparsities, method="random")
wb.teach.pruning.sparsity_curves(sweep, random, dense_accuracy).show()"""),
    new_code_cell("""table = sweep.pivot(index="sparsity", columns="finetuned", values="accuracy")
table.columns = ["pruned", "pruned + fine-tune"]
table["random"] = random.set_index("sparsity")["accuracy"]
table["non-zero weights"] = sweep[sweep["finetuned"]].set_index("sparsity")["nonzero_weights"]
table"""),
    new_markdown_cell("""Note the last column of the sweep (`dense_bytes`): unstructured zeros stored densely save
**no** bytes. Saving bytes needs a sparse format (`storage="csr"` stores 8 bytes per kept weight, so it pays only above
50 % sparsity) - and saving *time* needs kernels that skip the zeros.

## 3. Structured pruning: smaller layers, real speed

Structured pruning ranks whole output channels, here by the L1 norm of each channel's weights
$\\lVert W_{c,:}\\rVert_1 = \\sum_j |W_{c,j}|$, and removes the smallest. `wb.prune.channels` then rebuilds
every dependent layer: the BatchNorm after a convolution and the input of the next layer lose the same
channels. Pruning half the channels of two consecutive convolutions quarters the work of the second.

**Exercise 3.** Which 8 of `conv1`'s 32 output channels does 25 % L1 structured pruning remove? Give their
indices (a list or a tensor, any order)."""),
    new_code_cell("""w1 = model.conv1.weight
print("conv1 weight:", tuple(w1.shape))
# Exercise 3 - the indices of the 8 channels with the smallest L1 norm. Replace ... with your code.
answer = ...
answer = w1.abs().sum(dim=(1, 2, 3)).argsort()[:8] if solutions else answer
wb.teach.pruning.check_removed_channels(answer, w1, amount=0.25)"""),
    new_code_cell("""wb.teach.pruning.channel_norms(model, "conv1", amount=0.25).show()"""),
    new_markdown_cell("""Now the same fraction, `amount`, removed two ways from every selected layer - unstructured
magnitude (zeros kept in dense tensors) and structured (channels physically removed) - each followed by the same short
fine-tune, then measured side by side with `wb.measure` (median latency at a fixed thread count)."""),
    new_code_cell("""inputs = task.example_inputs(batch_size)
masked = wb.apply(model, {p: wb.prune.Magnitude(amount) for p in patterns})
unstructured_before = task.evaluate(masked)["accuracy"]
wb.training.fit_classifier(masked, task, epochs=finetune_epochs, lr=finetune_lr)
unstructured = wb.prune.finalize(masked, "dense")

structured = wb.prune.channels(model, {p: amount for p in patterns}, criterion="l1", example_inputs=inputs)
structured_before = task.evaluate(structured)["accuracy"]
wb.training.fit_classifier(structured, task, epochs=finetune_epochs, lr=finetune_lr)
print(f"accuracy right after pruning: unstructured {unstructured_before:.4f}, structured {structured_before:.4f}")
structured"""),
    new_code_cell("""labels = ["dense", f"unstructured {amount:.0%}", f"structured {amount:.0%}"]
results = [wb.measure(m, task, batch_size=batch_size, threads=threads) for m in (model, unstructured, structured)]
wb.compare(*results, labels=labels)"""),
    new_code_cell("""wb.plots.comparison_bars(results, labels=labels).show()"""),
    new_markdown_cell("""Unstructured pruning keeps the model's size and speed: its zeros are stored and multiplied like
any other weight. Structured pruning makes the model smaller and faster on any hardware, at a larger accuracy cost
before fine-tuning. (2:4 sits in between: it needs GPU sparse tensor cores to run faster, which this CPU lacks.)

## Summary

The values below are recorded in the notebook's outputs; the regression suite reads them back."""),
    new_code_cell("""done = wb.teach.summary()
at = sweep.set_index(["sparsity", "finetuned"])["accuracy"]
wb.reports.record(
    dense_accuracy=dense_accuracy,
    global_conv1_sparsity=wb.teach.pruning.mask_sparsity(conv1_mask),
    nm_kept_conv2=nm_kept,
    pruned_50_accuracy=at[(0.5, False)],
    pruned_90_accuracy=at[(0.9, False)],
    finetuned_50_accuracy=at[(0.5, True)],
    finetuned_90_accuracy=at[(0.9, True)],
    random_50_accuracy=random.set_index("sparsity")["accuracy"][0.5],
    unstructured_accuracy=results[1].primary_value,
    structured_accuracy_before_finetune=structured_before,
    structured_accuracy=results[2].primary_value,
    unstructured_size_ratio=results[1].size_bytes / results[0].size_bytes,
    structured_size_ratio=results[2].size_bytes / results[0].size_bytes,
    unstructured_speedup=results[0].latency_ms / results[1].latency_ms,
    structured_speedup=results[0].latency_ms / results[2].latency_ms,
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("20_pruning", cells)
