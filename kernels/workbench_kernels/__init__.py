"""Triton GPU kernels for low-bit inference, each paired with a pure-PyTorch reference of the same math.

One file per kernel, in the shape of Triton's matmul tutorial (docstring with the math and the blocking,
autotune configs from a function, the ``@triton.jit`` kernel, a launcher that checks -> allocates ->
launches, a reference, and a ``torch.library`` custom op with a fake implementation for ``torch.compile``):

- `int8_weight_only` - ``workbench::int8_weight_only_mm``: int8 per-channel weights, fp16/bf16 activations;
- `int4_weight_only` - ``workbench::int4_weight_only_mm``: int4 packed two per byte, group scales (and zeros),
  dequantized in the main loop; split-K configs for decode-sized M;
- `w8a8` - ``workbench::quantize_per_token``, ``workbench::w8a8_mm``: per-token int8 activations quantized
  inside the GEMM (small M) or by a separate pass (large M), int32 accumulation, fused rescale epilogue;
- `fake_quant` - ``workbench::fake_quantize`` (+ backward): QAT fake quantization with the straight-through
  gradient, per channel or per group;
- `fp8` - ``workbench::fp8_scaled_mm``: e4m3 x e4m3 with row-wise scales on sm_90;
- `w8a8_cpu` - ``workbench::w8a8_linear_cpu``: the CPU fast path of W8A8 (C++: per-token quantization, oneDNN's
  int8 GEMM and the rescale fused block by block of rows); `weight_only_cpu` and `act_int8_cpu`: the CPU paths of
  weight-only layers (C++); `ops`: both as ``torch.library`` ops. The C++ is built by ``make install``
  (``python -m workbench_kernels.build``), or else quietly on first use (a message on the ``logging`` logger of
  each module, never on stderr).

`isa` says which x86 instruction sets the CPU code may use and how one machine runs as another CPU class (the caps
of PyTorch, oneDNN, MKL and these kernels; ``make test-isa``).

Their benchmarks live in `workbench.benchmarks` (``kernels``, ``kernels_cpu``, ``kernels_e2e``; the measurements in
docs/kernels.md), outside this package: the kernels import nothing above them. The quantized modules of
`workbench.quantization` call the Triton kernels with ``kernel="triton"`` and `w8a8_cpu` with ``kernel="cpu"``.
Importing this package does not import Triton or initialise CUDA: each kernel module imports Triton when it is
imported. `triton_available` is what the quantized modules ask before they pick a Triton kernel.
"""
from workbench_kernels._common import chosen_config, graph_bench, triton_available

__all__ = ["triton_available", "graph_bench", "chosen_config"]
