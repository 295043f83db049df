"""Write notebooks/50_kernels.ipynb - the workshop lesson on kernels and the roofline (run after editing)."""
from nbformat.v4 import new_code_cell, new_markdown_cell

from notebook_writer import write

cells = [
    new_markdown_cell("""# 50 · Kernels and the roofline: why a quantized model is (or is not) faster

The most common complaint about compression libraries is *"my quantized model is slower"*. This lesson
measures why. A kernel needs at least

$$t \\ge \\max\\left(\\frac{\\text{bytes moved}}{\\text{bandwidth}},\\ \\frac{\\text{FLOPs}}{\\text{peak}}\\right)
\\qquad I = \\frac{\\text{FLOPs}}{\\text{bytes}}\\ \\text{(arithmetic intensity)}$$

so the best throughput it can reach is $\\min(\\text{peak},\\ \\text{bandwidth}\\times I)$: the **roofline**.
A Linear layer $y = xW^T$ with $x$ of shape $(M, K)$ does $2MKN$ FLOPs. At $M = 1$ (decoding one token) it
reads every weight once for two FLOPs: it is **memory-bound**, and storing the weight in fewer bits can speed
it up by at most the byte ratio - e.g. $16 / (4 + 16/128) = 3.88\\times$ for int4 with one fp16 scale per 128
weights, against bf16. At large $M$ it is **compute-bound**: only faster arithmetic (int8 dot products) helps.

Every number below is measured on this machine (the CPU here; GPU numbers appear when `python -m kernels.bench`
has been run on a GPU and its `kernels/results.csv` kept)."""),
    new_code_cell("""# Parameters (papermill replaces these values)
threads = 1              # CPU threads for every timing (the CPU target is stated at one thread)
batches = [1, 32, 512]   # M: rows of x (tokens) per call
rounds = 9               # interleaved timing rounds per layer (medians)
minilm_batch = 4         # sentences of 128 tokens for the whole-model comparison
solutions = False        # True fills in the exercises (the regression run)""", metadata={"tags": ["parameters"]}),
    new_code_cell("""import torch

import workbench as wb
from kernels import bench

print(bench.environment())"""),
    new_markdown_cell("""## 1. This machine's two roofs

The memory roof is the copy bandwidth (bytes read + written per second of a large `copy_`); the compute roof is
the fp32 matmul throughput of a large square product, both at the lesson's thread count."""),
    new_code_cell("""with wb.measurement.num_threads(threads):
    bandwidth = bench.copy_bandwidth("cpu", 1 << 27) / 1e9
    peak = wb.analysis.estimate.matmul_flops_per_s(threads) / 1e9
print(f"copy bandwidth {bandwidth:.1f} GB/s, fp32 matmul {peak:.1f} GFLOP/s, "
      f"ridge point {peak / bandwidth:.2f} FLOP/byte")"""),
    new_markdown_cell("""### Exercise 1 - the ceiling of a weight-only format

What is the largest speedup over bf16 weights that an **int4 weight with one fp16 scale per 128 weights** can
give a memory-bound layer with 4096 inputs? (A number.)"""),
    new_code_cell("""answer = ...
answer = 16 / (4 + 16 / 128) if solutions else answer
wb.teach.kernels.check_ceiling(answer, bits=4, group_size=128, in_features=4096)"""),
    new_markdown_cell("""## 2. One Linear layer, every path

MiniLM's two FFN shapes (384→1536 and 1536→384) at several batch sizes, each path timed in interleaved rounds:

- `fp32`, `bf16`: plain `F.linear`;
- `w8a8 cpu`: `wb.quant.Dynamic(kernel="cpu")` - per-token int8 activations, `torch._int_mm` (oneDNN), fp32
  rescale, fused block by block in C++ (`kernels/w8a8_cpu.cpp`);
- `int8 weight-only cpu`: int8 weights read as stored by `kernels/weight_only_cpu.cpp` (decoded in registers at
  small M; blocks of decoded rows and an fp32 GEMM at large M);
- `int4 g64 weight-only`: the reference path (`kernel="reference"`: decode to fp32, then an fp32 GEMM).

`ceiling` is the byte ratio of the stored weights (fp32 bytes / the path's bytes)."""),
    new_code_cell("""layers = bench.cpu_layer_table(ms=batches, threads=threads, rounds=rounds)
layers.round(3)"""),
    new_code_cell("""wb.teach.kernels.roofline_chart(layers, bandwidth, peak).show()"""),
    new_code_cell("""wb.teach.kernels.speedup_chart(layers).show()"""),
    new_markdown_cell("""What to look for:

- At **M = 1** every path sits on the memory slope, far left. Decoding the weight *in PyTorch* reads the packed
  bytes and then writes and re-reads a full float copy, so the weight-only paths move **more** bytes than fp32
  and are slower: the byte-ratio ceiling is only reachable by a kernel that dequantizes in registers (the Triton
  kernels in `kernels/` on a GPU, `kernels/weight_only_cpu.cpp` here - the `int8 weight-only cpu` row).
- At **M = 512** the layer is compute-bound: `w8a8 cpu` beats fp32 because int8 dot products (VNNI) do more
  work per cycle - a speedup the byte ratio does not predict - while weight-only formats still compute in float.

### Exercise 2 - arithmetic intensity

Compute the arithmetic intensity (FLOPs per byte) of the fp32 layer 384→1536 at M = 1: weights 4 bytes each,
inputs and outputs 4 bytes each."""),
    new_code_cell("""answer = ...
answer = 2 * 1 * 384 * 1536 / (384 * 1536 * 4 + 4 * (1 * 384 + 1 * 1536)) if solutions else answer
wb.teach.kernels.check_intensity(answer, M=1, K=384, N=1536, weight_bytes_per_value=4)"""),
    new_markdown_cell("""### Exercise 3 - which roof?

On *this* machine (the bandwidth and peak measured above), is the fp32 layer 384→1536 at M = 512
`"memory"`- or `"compute"`-bound?"""),
    new_code_cell("""answer = ...
answer = ("memory" if 2 * 512 * 384 * 1536 / (384 * 1536 * 4 + 4 * 512 * (384 + 1536)) < peak / bandwidth
          else "compute") if solutions else answer
wb.teach.kernels.check_bound(answer, M=512, K=384, N=1536, weight_bytes_per_value=4, bandwidth_GBs=bandwidth,
                             peak_GFLOPs=peak)"""),
    new_markdown_cell("""## 3. The whole model

MiniLM with every encoder Linear in W8A8: our CPU path against fp32 and against
`torch.ao.quantization.quantize_dynamic` on the same layers (fbgemm's fused kernels), plus the reference path
and int8 weight-only on the bf16 path. `page_faults` counts the minor page faults per forward: memory the
allocator gave back to the operating system and has to fault in again. At large batches they cost every path
milliseconds, differently from run to run - one reason to compare paths in interleaved rounds, never from two
separate runs. The full-size comparison (32 × 128 tokens, one thread) is `python -m kernels.bench --cpu`; its
results are in `kernels/README.md`."""),
    new_code_cell("""model_paths = bench.cpu_minilm(batch_sizes=(minilm_batch,), threads=threads, rounds=3)
model_paths.round(3)"""),
    new_markdown_cell("""## 4. On a GPU

`python -m kernels.bench --gpu` times the Triton kernels (int8 / int4 weight-only, W8A8, fp8) against bf16
cuBLAS and torchao on Llama-sized shapes, with the effective bandwidth as a fraction of the device's copy
bandwidth. Rows recorded in `kernels/results.csv` are shown here."""),
    new_code_cell("""gpu = bench.gpu_results()
print(f"{len(gpu)} GPU rows recorded" if len(gpu) else "no GPU results recorded in kernels/results.csv yet")
gpu.head(30)"""),
    new_markdown_cell("The values below are recorded in the notebook's outputs (the regression suite reads them)."),
    new_code_cell("""big = layers[layers["M"] == max(batches)].set_index(["shape", "path"])["speedup"]
one = layers[layers["M"] == min(batches)].set_index(["shape", "path"])["speedup"]
ours = model_paths.set_index("path")
progress = wb.teach.summary()
wb.reports.record(
    w8a8_speedup_large_m=float(big.xs("w8a8 cpu", level="path").min()),
    int4_ref_speedup_m1=float(one.xs("int4 g64 weight-only", level="path").max()),
    int4_g64_ceiling=float(layers[layers["path"] == "int4 g64 weight-only"]["ceiling"].iloc[0]),
    minilm_w8a8_speedup=float(ours.loc["w8a8 cpu (ours)", "speedup_vs_fp32"]),
    minilm_w8a8_vs_quantize_dynamic=float(ours.loc["w8a8 cpu (ours)", "vs_quantize_dynamic"]),
    exercises=progress["exercises"],
    exercises_passed=progress["passed"],
)"""),
]

write("50_kernels", cells)
