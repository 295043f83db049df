"""``torch.library`` custom ops over the C++ CPU kernels, so ``torch.compile`` keeps them as graph nodes.

Eager code calls the C++ extensions through pybind (`workbench_kernels.weight_only_cpu.linear_unchecked`): one
call, no dispatcher, but dynamo cannot trace it and would break the graph at every quantized Linear. Under
``torch.compile`` `WeightOnlyLinear.forward` calls `weight_only_linear_cpu` below instead: the op
``workbench::weight_only_linear_cpu`` takes the packed weight's tensors and its path rules as plain arguments
(the rules are Python ints of the packed weight, constants of the graph) and runs the same extension call, so a
compiled model computes exactly what the eager one does. Its fake implementation gives inductor the output's
shape and dtype: ``x (..., K) -> (..., N)`` in x's dtype.

``workbench::act_int8_linear_cpu`` is `workbench_kernels.act_int8_cpu`'s kernel (``kernel="cpu-int8"``: activations
rounded to int8) the same way: the stored tensors as they are, the same extension call.

``workbench::dense_gemv_cpu`` is the dense fp32 GEMV of ``weight_only_cpu.cpp``; no module calls it: `DenseGemvPass`,
an inductor post-grad pass, puts it in place of the products of one fp32 row by an fp32 weight in a compiled graph
(the decode step of `workbench.measurement.decode` compiles with it).

``workbench::decode_attention_cpu`` is the attention of one query position over a key / value cache (fp32, grouped
query heads read as they are, the positions a mask leaves and no others); `DecodeAttentionPass` puts it in place of
PyTorch's CPU flash attention where the query is one position (a decode step: ~40 us a layer for flash attention's
set-up on tiny-llama's 4 heads, against a few us). `DecodeStepPass` runs both passes.

Each op's schema and fake implementation are defined here, its CPU implementation by the extension (C++
``TORCH_LIBRARY_IMPL``, registered when the extension loads): no Python runs between the dispatcher and the kernel.

(`workbench_kernels.w8a8_cpu` registers its own op next to its kernel; this file holds the ops of the weight-only
kernels, whose source files are shared with other work.)
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from workbench_kernels import act_int8_cpu, weight_only_cpu

__all__ = ["DecodeAttentionPass", "DecodeStepPass", "DenseGemvPass", "act_int8_linear_cpu", "decode_attention_cpu",
           "dense_gemv_cpu", "weight_only_linear_cpu"]


# The schema here, the CPU implementation in weight_only_cpu.cpp (TORCH_LIBRARY_IMPL, registered when the extension
# loads, below): the dispatcher calls the C++ directly. A Python implementation (torch.library.impl) cost ~14 us a
# call over the bare extension call (0.8 ms a token on tiny-llama's 56 quantized Linears; the @custom_op
# decorator's wrappers ~7 us more).
torch.library.define("workbench::weight_only_linear_cpu",
                     "(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, Tensor? lut, Tensor? bias, int bits, "
                     "int group_size, int K, int[] rules, Tensor? scale16, float zconst) -> Tensor")
weight_only_cpu.load_extension()   # (this module is imported where the kernel runs: its extension is built)


@torch.library.register_fake("workbench::weight_only_linear_cpu")
def _(x, qweight, scale, zero, lut, bias, bits, group_size, K, rules, scale16, zconst):
    if x.shape[-1] != K:
        raise ValueError(f"weight_only_linear_cpu: x must have shape (..., K = {K}), got {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def weight_only_linear_cpu(x: torch.Tensor, w: weight_only_cpu.CpuWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``y (..., N)`` in x's dtype: `weight_only_cpu.linear_unchecked` (default path rules) as the custom op."""
    rules = [int(r) for r in w.call_rules]
    return torch.ops.workbench.weight_only_linear_cpu.default(x, w.qweight, w.scale, w.zero, w.lut, bias, w.bits,
                                                              w.group_size, w.K, rules, w.scale16, w.zconst)


torch.library.define("workbench::act_int8_linear_cpu",
                     "(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, float zconst, int bits, int group, "
                     "int K, Tensor? bias) -> Tensor")


try:
    act_int8_cpu.load_extension()   # (its CPU implementation: act_int8_cpu.cpp, as above)
except RuntimeError:   # not built here: no layer runs kernel="cpu-int8" then (the other ops stand on their own)
    pass


@torch.library.register_fake("workbench::act_int8_linear_cpu")
def _(x, qweight, scale, zero, zconst, bits, group, K, bias):
    if x.shape[-1] != K:
        raise ValueError(f"act_int8_linear_cpu: x must have shape (..., K = {K}), got {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def act_int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        zconst: float, bits: int, group: int, K: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``y (..., N)`` in x's dtype: `act_int8_cpu.linear_unchecked` as the custom op."""
    return torch.ops.workbench.act_int8_linear_cpu.default(x, qweight, scale, zero, zconst, bits, group, K, bias)


# fp32 Linears at one row (a decode step's dense layers and head): weight_only_cpu.cpp's dense GEMV (AVX-512 / AVX2;
# elsewhere at::linear). Reached in a compiled graph through `DenseGemvPass`, not through the modules.
torch.library.define("workbench::dense_gemv_cpu", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.register_fake("workbench::dense_gemv_cpu")
def _(x, weight, bias):
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"dense_gemv_cpu: x must have shape (..., K = {weight.shape[1]}), got {tuple(x.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def dense_gemv_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (..., K) @ weight.T + bias``: the dense GEMV where x is one fp32 row (see above), else ``F.linear``."""
    return torch.ops.workbench.dense_gemv_cpu.default(x, weight, bias)


# attention of one query position (a decode step): weight_only_cpu.cpp's kernel for fp32 (AVX-512 / AVX2 / scalar);
# other inputs go to PyTorch's CPU flash attention, the op the pass below replaces
torch.library.define("workbench::decode_attention_cpu",
                     "(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale) -> Tensor")


@torch.library.register_fake("workbench::decode_attention_cpu")
def _(q, k, v, mask, scale):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] % k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"decode_attention_cpu: q (B, Hq, T, D), k (B, Hkv, L, D) and v (B, Hkv, L, Dv) with Hq a "
                         f"multiple of Hkv are needed, got q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)}")
    return q.new_empty((*q.shape[:3], v.shape[3]))


def decode_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                         scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for q ``(B, Hq, T, D)`` and k / v ``(B, Hkv, L, D)``, query head h
    reading key / value head ``h // (Hq // Hkv)``; ``mask`` broadcastable to ``(B, Hq, T, L)``, bool (True:
    attend) or float (added); ``scale`` 1 / sqrt(D) by default. The kernel where T is 1 and the tensors are fp32,
    PyTorch's CPU flash attention otherwise; a query head with every position masked gives zeros."""
    return torch.ops.workbench.decode_attention_cpu.default(q, k, v, mask, scale)


class DecodeAttentionPass(CustomGraphPass):
    """An inductor post-grad pass: PyTorch's CPU flash attention
    (``aten._scaled_dot_product_flash_attention_for_cpu``, what ``F.scaled_dot_product_attention`` becomes on the
    CPU) of one fp32 query position, no dropout, not causal, its log-sum-exp unused, runs `decode_attention_cpu`.
    Other attention is left as it is."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        import operator

        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not flash:
                continue
            q, k, v = node.args[:3]
            dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
            causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
            mask, scale = node.kwargs.get("attn_mask"), node.kwargs.get("scale")
            users = list(node.users)
            if (not users or dropout != 0.0 or causal or not _is_one_query(q)
                    or not all(_is_fp32_cpu(t, 4) for t in (k, v))
                    or not all(u.target is operator.getitem and u.args[1] == 0 for u in users)
                    or (mask is not None and _val(mask) is None)):
                continue
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.workbench.decode_attention_cpu.default, (q, k, v, mask, scale))
            new.meta.update(users[0].meta)   # (the output's val: (B, Hq, 1, Dv), the op's own layout)
            for u in users:
                u.replace_all_uses_with(new)
                graph.erase_node(u)
            graph.erase_node(node)

    def uuid(self) -> str:
        return f"workbench.DecodeAttentionPass:{_PASS_VERSION}"


class DecodeStepPass(CustomGraphPass):
    """`DenseGemvPass`, then `DecodeAttentionPass`: the post-grad pass the decode step compiles with."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        DenseGemvPass()(graph)
        DecodeAttentionPass()(graph)

    def uuid(self) -> str:
        return f"workbench.DecodeStepPass:{_PASS_VERSION}"


class DenseGemvPass(CustomGraphPass):
    """An inductor post-grad pass (``options={"post_grad_custom_post_pass": DenseGemvPass()}``): every product of
    one fp32 row by a transposed 2-D fp32 CPU tensor - ``mm(x, permute(w, [1, 0]))`` or ``addmm(b, x, permute(w,
    [1, 0]))``, what ``F.linear`` becomes - runs `dense_gemv_cpu` on ``w`` as stored. Other products are left
    as they are."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            if node.target is aten.addmm.default:
                if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                    continue
                bias, x, wt = node.args[:3]
                if not _is_row_bias(bias, wt):
                    continue
            else:
                bias, (x, wt) = None, node.args[:2]
            if not (_is_one_fp32_row(x) and _is_transposed_weight(wt)):
                continue
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.workbench.dense_gemv_cpu.default, (x, wt.args[0], bias))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            if not wt.users:
                graph.erase_node(wt)

    def uuid(self) -> str:
        return f"workbench.DenseGemvPass:{_PASS_VERSION}"


_PASS_VERSION = 1   # (part of inductor's cache key: bump when the pass changes what it rewrites)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_one_fp32_row(x) -> bool:
    v = _val(x)
    return (isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] == 1 and v.dtype == torch.float32
            and v.device.type == "cpu" and v.is_contiguous())


def _is_fp32_cpu(x, dim: int) -> bool:
    v = _val(x)
    return isinstance(v, torch.Tensor) and v.dim() == dim and v.dtype == torch.float32 and v.device.type == "cpu"


def _is_one_query(q) -> bool:
    return _is_fp32_cpu(q, 4) and _val(q).shape[2] == 1


def _is_transposed_weight(wt) -> bool:
    if not (isinstance(wt, torch.fx.Node) and wt.target is torch.ops.aten.permute.default
            and list(wt.args[1]) == [1, 0]):
        return False
    v = _val(wt.args[0])
    return (isinstance(v, torch.Tensor) and v.dim() == 2 and v.dtype == torch.float32 and v.device.type == "cpu"
            and v.is_contiguous())


def _is_row_bias(bias, wt) -> bool:
    v, w = _val(bias), _val(wt)
    return (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.dim() == 1 and v.dtype == torch.float32
            and v.shape[0] == w.shape[1] and v.is_contiguous())
