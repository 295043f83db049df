"""Write notebooks/30_distillation.ipynb (the knowledge-distillation lesson) from the cells below; run after
editing them: ``cd tools && ../.venv/bin/python make_30_distillation_notebook.py``."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# Knowledge distillation: a small student learns from a large teacher

A trained **teacher** knows more than the labels say: when it reads a sloppy 3, it gives a little probability
to 8 and 5 and almost none to 1. Distillation trains a small **student** to match those probabilities.

The teacher's logits $z$ are softened with a **temperature** $T$:

$$p_i(T) = \\frac{e^{z_i/T}}{\\sum_j e^{z_j/T}}$$

$T=1$ is the ordinary softmax; a larger $T$ flattens it, so the small probabilities (the "dark knowledge")
carry weight. The student minimises (Hinton et al., 2015; `wb.distill.kd_loss`)

$$L = (1-\\alpha)\\,\\mathrm{CE}(\\text{student}, y)
    + \\alpha\\,T^2\\,\\mathrm{KL}\\big(p^{\\text{teacher}}(T)\\,\\|\\,p^{\\text{student}}(T)\\big)$$

You will look at a real teacher's soft targets at several temperatures, see why the loss carries a $T^2$, then
train the same small student with hard labels and with distillation and compare them on the test set.
Exercises are marked **Exercise**: replace `...` with your code and run the cell."""),
    new_code_cell("""# Parameters (papermill replaces these values; solutions=True fills in the exercises)
solutions = False
teacher_name = "digits-cnn"      # the teacher, from wb.models
temperatures = [1, 2, 4, 8]      # the temperatures drawn
example_rank = 0                 # 0: the test digit whose runner-up class the teacher rates highest
hidden = [64, 32]                # the student: MLP 64 -> hidden -> 10
epochs = 60                      # training budget of every student
lr = 3e-3
alpha = 0.9                      # weight of the soft-target term in the KD loss
temperature = 4.0                # T of the KD loss
seeds = [0, 1, 2]                # one student per seed and method
threads = 1                      # CPU threads for training and every latency measurement""",
                  metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb

torch.set_num_threads(threads)   # small models train fastest on one thread, and a shared machine stays usable
teacher = wb.models.load(teacher_name)
task = wb.tasks.load("digits")
teacher_accuracy = task.evaluate(teacher)["accuracy"]
fresh = wb.teach.distillation.student(hidden, seed=0)
print(f"teacher {teacher_name}: {sum(p.numel() for p in teacher.parameters()):,} parameters, "
      f"test accuracy {teacher_accuracy:.4f}")
print(f"student MLP 64-{'-'.join(map(str, hidden))}-10: {sum(p.numel() for p in fresh.parameters()):,} parameters")"""),
    new_markdown_cell("""## 1. Soft targets and temperature

One test digit the teacher gets right, but with a clear runner-up. On a log scale you can read the
probabilities of every class; watch the wrong classes rise as $T$ grows, and the entropy climb towards the
uniform distribution's $\\log_2 10 = 3.32$ bits."""),
    new_code_cell("""index = wb.teach.distillation.pick_example(teacher, task, rank=example_rank)
image = torch.from_numpy(task.split.x_test[index])
label = int(task.split.y_test[index])
with torch.no_grad():
    logits = teacher(image[None])[0]
print("teacher logits:", [round(v, 2) for v in logits.tolist()])
wb.teach.distillation.temperature_figure(logits, temperatures, image=image, label=label).show()"""),
    new_markdown_cell("""**Exercise 1.** Compute the teacher's soft targets for this example at $T = 4$: a tensor of 10
probabilities."""),
    new_code_cell("""# Exercise 1 - softmax of `logits` at temperature 4. Replace ... with your code.
answer = ...
answer = torch.softmax(logits / 4, dim=-1) if solutions else answer
wb.teach.distillation.check_softmax_t(answer, logits, temperature=4)"""),
    new_markdown_cell("""**Exercise 2.** Which of the temperatures in `temperatures` gives the flattest distribution for
this example (the highest entropy)?"""),
    new_code_cell("""# Exercise 2 - one of the values in `temperatures`. Replace ... with your answer.
answer = ...
answer = max(temperatures) if solutions else answer
wb.teach.distillation.check_flattest(answer, logits, temperatures)"""),
    new_markdown_cell("""## 2. Why the loss carries $T^2$

The gradient of the KL term with respect to the student's logits is
$\\frac{1}{T}\\big(p^{\\text{student}}(T) - p^{\\text{teacher}}(T)\\big)$, and as $T$ grows both distributions
approach uniform, so their difference shrinks like $1/T$ as well. Below, the measured gradient norm for a real
batch (an untrained student against the teacher): without a correction it collapses as $T$ grows, and the
soft term would stop counting next to the hard-label term."""),
    new_code_cell("""batch = task.calibration(128)[0][0]
with torch.no_grad():
    student_logits, teacher_logits = fresh(batch), teacher(batch)
gradients = wb.teach.distillation.soft_gradient_norms(student_logits, teacher_logits, temperatures)
gradients"""),
    new_markdown_cell("""**Exercise 3.** By what factor must the KL term be multiplied at `temperature` (the $T$ of our
KD runs) to keep its gradients on the scale they have at $T = 1$?"""),
    new_code_cell("""# Exercise 3 - the factor for T = temperature. Replace ... with your code.
answer = ...
answer = temperature ** 2 if solutions else answer
wb.teach.distillation.check_t_squared(answer, temperature)"""),
    new_markdown_cell("""## 3. Hard labels vs distillation

The same student architecture, the same initial weights (one per seed), the same epochs and learning rate,
trained two ways with `wb.distill.fit`: with hard labels only ($\\alpha = 0$) and with the teacher's soft targets
($\\alpha$ = `alpha`, $T$ = `temperature`). `fit` keeps 10 % of the training split for validation and restores
the best epoch's weights; the test split is only used for the final accuracy.

A difference of one point on 540 test digits is about five digits: look at every seed, not only the mean."""),
    new_code_cell("""runs, histories, students = wb.teach.distillation.compare_kd(
    teacher, task, seeds=seeds, hidden=hidden, epochs=epochs, lr=lr, alpha=alpha, temperature=temperature)
wb.teach.distillation.kd_figure(runs, histories, teacher_accuracy).show()
runs.pivot(index="seed", columns="method", values="accuracy")"""),
    new_code_cell("""mean = runs.groupby("method")["accuracy"].mean()
kd_gain = mean["KD"] - mean["hard labels"]
print(f"mean test accuracy: hard labels {mean['hard labels']:.4f}, KD {mean['KD']:.4f} "
      f"({100 * kd_gain:+.2f} points); teacher {teacher_accuracy:.4f}")"""),
    new_markdown_cell("""## 4. What the student buys

Teacher and the first KD student measured side by side: accuracy, latency (median of timed runs at a fixed
thread count), bytes of the weights, peak memory of a forward pass."""),
    new_code_cell("""student_kd = students[("KD", seeds[0])]
labels = [f"teacher ({teacher_name})", "KD student"]
measured = [wb.measure(m, task, threads=threads) for m in (teacher, student_kd)]
wb.compare(*measured, labels=labels)"""),
    new_code_cell("""wb.plots.comparison_bars(measured, labels=labels).show()"""),
    new_markdown_cell("""`wb.distill.fit` also matches intermediate features (`features={student layer: teacher layer}`,
through a learned projection where widths differ), and `wb.distill.fit_embeddings` distils sentence encoders;
a pruned or quantized copy of the teacher is a natural student too.

## Summary

The values below are recorded in the notebook's outputs; the regression suite reads them back."""),
    new_code_cell("""done = wb.teach.summary()
wb.reports.record(
    teacher_accuracy=teacher_accuracy,
    example_index=index,
    entropy_t1=float(wb.teach.distillation.entropy(wb.teach.distillation.soft_targets(logits, 1))),
    entropy_t8=float(wb.teach.distillation.entropy(wb.teach.distillation.soft_targets(logits, 8))),
    gradient_ratio_t1_t8=gradients.iloc[0, 0] / gradients.iloc[-1, 0],
    hard_accuracy=mean["hard labels"],
    kd_accuracy=mean["KD"],
    kd_gain=kd_gain,
    student_size_ratio=measured[1].size_bytes / measured[0].size_bytes,
    student_speedup=measured[0].latency_ms / measured[1].latency_ms,
    exercises=done["exercises"],
    exercises_passed=done["passed"],
)"""),
]

write("30_distillation", cells)
