"""workbench_kernels.weight_only_cpu against its PyTorch reference: every format it takes, ragged shapes (K, N and group
sizes that are not multiples of the vector width, short last groups), both paths (decode: fp32 within 1e-5;
prefill: bit for bit the reference's decoded weight times the same GEMM), each ISA this CPU has, two threads,
fp16 / bf16 inputs, bad inputs refused by name; plus smoke runs of the benchmarks in
workbench.benchmarks.kernels_cpu."""
import math

import pytest
import torch

from workbench.quantization import formats as fm
from workbench_kernels import weight_only_cpu as wk

FORMATS = [fm.IntFormat(4, 128), fm.IntFormat(4, 32), fm.IntFormat(8, 32), fm.IntFormat(4, 32, symmetric=False),
           fm.IntFormat(4, 48, False, float_zero=True),
           fm.IntFormat(8, None), fm.IntFormat(8, 64, symmetric=False), fm.IntFormat(3, 24), fm.IntFormat(2, 16, False),
           fm.NF4Format(64)]
ISAS = ["scalar", "avx2", "avx512"][:("scalar", "avx2", "avx512").index(wk.cpu_isa()) + 1]   # every one this CPU has


def _layer(fmt, N, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen)
    t = fm.encode(w, fmt)
    return t, wk.pack(t, fmt, K), fm.decode(t, fmt, K)                    # stored, kernel view, fp32 (N, K)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_matches_the_reference_on_ragged_shapes(fmt, isa):
    for N, K in [(37, 203), (8, 256), (65, 96)]:
        _, w, dense = _layer(fmt, N, K)
        bias = torch.randn(N)
        for M in (1, 3, 5, 17, 33):
            x = torch.randn(M, K)
            expected = torch.nn.functional.linear(x, dense, bias)
            got = wk.weight_only_linear_cpu(x, w, bias, isa=isa)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
            torch.testing.assert_close(wk.reference(x, w, bias), expected, rtol=1e-6, atol=1e-6)
        x = torch.randn(40, K)                     # prefill path: the reference's decoded weight, the same GEMM
        assert torch.equal(wk.weight_only_linear_cpu(x, w, bias, isa=isa), torch.nn.functional.linear(x, dense, bias))


@pytest.mark.parametrize("fmt", [fm.IntFormat(4, 32), fm.IntFormat(8, 64), fm.IntFormat(4, 32, symmetric=False)],
                         ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_the_decode_path_reads_the_stored_fp16_scales_and_one_zero_point(fmt, isa):
    import dataclasses

    t, w, dense = _layer(fmt, 70, 352)   # 11 groups of 32: an odd count, a short vector tail
    assert w.scale16 is t["scale"] and w.scale16.dtype == torch.float16    # the stored tensor, no copy
    if fmt.symmetric:
        assert w.zconst == 1 << (fmt.bits - 1)
    else:
        assert math.isnan(w.zconst)                                         # NaN: the zero points per group
    fp32_copy = dataclasses.replace(w, scale16=None, zconst=float("nan"))   # the fp32 scales and zeros instead
    for M in (1, 2, 5):
        x = torch.randn(M, 352)
        got = wk.weight_only_linear_cpu(x, w, isa=isa)
        copy = wk.weight_only_linear_cpu(x, fp32_copy, isa=isa)
        expected = torch.nn.functional.linear(x, dense)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        if not fmt.symmetric or isa == "scalar":   # the same sums, the scales read from fp16 instead of fp32
            # (the scalar code decodes each row into fp32 weights first, whatever the zero points)
            torch.testing.assert_close(got, copy, rtol=1e-6, atol=1e-6)
            continue
        # one zero point: folded into the codes (u - z, then one fp32 dot per group), where the per-group zeros'
        # path sums u x and subtracts a large zero share - the folded sum is closer to the exact product
        if M > w.prefill_rows:   # the prefill path: the decoded weight times x, whichever zero points
            assert torch.equal(got, copy)
            continue
        exact = torch.nn.functional.linear(x.double(), dense.double())
        assert (got.double() - exact).norm() < (copy.double() - exact).norm()


@pytest.mark.parametrize("isa", ISAS)
def test_both_paths_agree_and_threads_do_not_change_the_result(isa):
    _, w, _ = _layer(fm.IntFormat(4, 64, symmetric=False), 300, 512)
    x = torch.randn(2, 9, 512)
    one = wk.weight_only_linear_cpu(x, w, prefill_rows=10 ** 6, isa=isa)   # decode path for every row
    pre = wk.weight_only_linear_cpu(x, w, prefill_rows=0, isa=isa)         # prefill path for every row
    assert one.shape == (2, 9, 300)
    torch.testing.assert_close(one, pre, rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(wk.weight_only_linear_cpu(x, w, prefill_rows=10 ** 6, isa=isa), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_fp32_and_return_their_dtype(dtype):
    _, w, dense = _layer(fm.IntFormat(4, 32), 48, 96)
    x = torch.randn(3, 96).to(dtype)
    y = wk.weight_only_linear_cpu(x, w)
    assert y.dtype == dtype
    torch.testing.assert_close(y, torch.nn.functional.linear(x.float(), dense).to(dtype))


@pytest.mark.parametrize("N,K", [(48, 96), (1100, 1024)])   # one block of decoded rows; two (1 M-value bf16 blocks)
def test_bf16_prefill_is_the_references_bf16_math_where_the_cpu_has_bf16(N, K):
    """bf16 inputs above `PREFILL_ROWS`: on a CPU with bf16 arithmetic the kernel runs the reference's own bf16
    math (weight decoded in fp32, rounded to bf16, bf16 GEMM); elsewhere it computes in fp32 and rounds."""
    t, w, dense = _layer(fm.IntFormat(4, 32, symmetric=False), N, K)
    x = torch.randn(2, 20, K).to(torch.bfloat16)
    bias = torch.randn(N)
    y = wk.weight_only_linear_cpu(x, w, bias, split_rows=0)   # no AMX micro-kernels: oneDNN's bf16 GEMM
    assert y.dtype == torch.bfloat16 and y.shape == (2, 20, N)
    if wk.load_extension().native_bf16():
        expected = torch.nn.functional.linear(x, dense.to(torch.bfloat16), bias.to(torch.bfloat16))
        if N == 48:   # one block: the very GEMM the reference calls
            assert torch.equal(y, expected)
        else:         # column blocks: each output is still one bf16 dot product over all of K
            torch.testing.assert_close(y, expected, rtol=1.6e-2, atol=1e-2 * expected.abs().max().item())
    else:   # fp32 sums (the bias taken in x's dtype) in the kernel's order, rounded once to bf16
        b16 = bias.to(torch.bfloat16).double()
        exact = torch.nn.functional.linear(x.double(), dense.double(), b16)
        fp32_bound = (K + 1) * 2.0 ** -24 * (x.double().abs() @ dense.double().abs().T + b16.abs())
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + fp32_bound * (1 + 2.0 ** -8)).all()


def test_bad_inputs_are_refused_by_name():
    _, w, _ = _layer(fm.IntFormat(4, 32), 16, 64)
    with pytest.raises(ValueError, match="shape \\(..., K = 64\\)"):
        wk.weight_only_linear_cpu(torch.randn(2, 63), w)
    with pytest.raises(TypeError, match="x must be a float32"):
        wk.weight_only_linear_cpu(torch.ones(2, 64, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="bias must have shape \\(16,\\)"):
        wk.weight_only_linear_cpu(torch.randn(2, 64), w, torch.zeros(15))
    with pytest.raises(ValueError, match="isa must be one of"):
        wk.weight_only_linear_cpu(torch.randn(2, 64), w, isa="neon")
    with pytest.raises(ValueError, match="prefill_rows"):
        wk.weight_only_linear_cpu(torch.randn(2, 64), w, prefill_rows=-1)
    with pytest.raises(ValueError, match="no CPU kernel for FP8Format"):
        wk.pack(fm.encode(torch.randn(4, 8), fm.FP8Format()), fm.FP8Format(), 8)


def test_a_failed_build_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(wk, "_build", lambda: (None, RuntimeError("Error building extension\nc++: not found")))
    _, w, _ = _layer(fm.IntFormat(4, 32), 16, 64)
    with pytest.raises(RuntimeError, match="a working C\\+\\+ compiler.*c\\+\\+: not found.*kernel=.reference."):
        wk.weight_only_linear_cpu(torch.randn(2, 64), w)


def test_layer_benchmark_smoke():
    from workbench.benchmarks import kernels_cpu as bench_cpu

    df = bench_cpu.weight_only_table(256, 64, ms=(1, 20), rounds=1)
    assert set(df["M"]) == {1, 20} and (df["ms"] > 0).all() and (df["ms_min"] <= df["ms_max"]).all()
    row = df.set_index(["M", "path"]).loc[1]
    assert row.loc["int4 g128 WO auto (ours)", "kernel"] == "cpu"
    assert row.loc["int4 g128 WO reference", "kernel"] == "reference"
    assert row.loc["fp32", "vs_fp32"] == pytest.approx(1.0)
    assert row.loc["int8 WO auto (ours)", "ceiling_vs_fp32"] == pytest.approx(4 * 256 * 64 / (256 * 64 + 2 * 64))


def test_decode_benchmark_smoke_on_a_hugging_face_llama():
    """Any causal LM: a Hugging Face model from a small random config generates with its KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.benchmarks import kernels_cpu as bench_cpu

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    df = bench_cpu.decode_tokens_per_s(model, new_tokens=3, prompt_tokens=4, rounds=1,
                                       paths=("fp32", "int4 g64 WO", "W8A8 dynamic"))
    assert list(df["path"]) == ["fp32", "int4 g64 WO", "W8A8 dynamic"]
    assert (df["tokens_per_s"] > 0).all() and df["kv_cache"].all()
    assert df.set_index("path").loc["fp32", "same_tokens_as_fp32"]
    assert "WeightOnlyLinear:cpu x15" in df.set_index("path").loc["int4 g64 WO", "kernels"]


def test_measure_reports_tokens_per_s_for_causal_lms_only():
    import workbench as wb

    m = wb.measure(wb.models.load("tiny-lm"), "tiny-lm", quick=True, progress=False, generate_tokens=2)
    assert m.tokens_per_s > 0 and m.to_dict()["tokens_per_s"] == m.tokens_per_s
    with pytest.raises(ValueError, match="not a causal language model"):
        wb.measure(wb.models.load("digits-mlp"), "digits", quick=True, progress=False, generate_tokens=2)


def test_the_path_crossover_follows_the_weights_size():
    """Small weights (decoded whole and kept in cache for cheap) switch to decode + GEMM after a few rows, large
    ones after 16 (the crossovers measured in docs/kernels.md); the default call takes exactly the
    path its weight's `prefill_rows` names."""
    assert wk.prefill_rows_for(192, 192) == 2 and wk.prefill_rows_for(576, 192) == 3
    assert wk.prefill_rows_for(512, 512) == 7 and wk.prefill_rows_for(4096, 4096) == wk.PREFILL_ROWS == 16
    _, w, _ = _layer(fm.IntFormat(4, 64), 192, 192)
    assert w.prefill_rows == 2
    for M in (2, 3):
        x = torch.randn(M, 192)
        path = wk.weight_only_linear_cpu(x, w, prefill_rows=10 ** 6 if M <= 2 else 0)
        assert torch.equal(wk.weight_only_linear_cpu(x, w), path)


SPLIT = pytest.mark.skipif(not wk.split_available(), reason="the split path runs on CPUs with AMX bf16 tiles only")


@SPLIT
@pytest.mark.parametrize("fmt", [f for f in FORMATS if isinstance(f, fm.IntFormat) and not f.float_zero], ids=str)
def test_split_path_is_as_exact_as_the_fp32_reference(fmt):
    """fp32 x as three exact bf16 parts times the integer codes on AMX: against an fp64 product of the same decoded
    weight, its error is of the fp32 reference's own size (<= 3x it, and < 2e-6 of the largest output), on ragged
    shapes (odd K, short last groups, N and M not multiples of 16, more than one 64-row block of x)."""
    for N, K in [(37, 203), (8, 256), (65, 96), (130, 520)]:
        _, w, dense = _layer(fmt, N, K)
        assert w.split_ok
        bias = torch.randn(N)
        for M in (17, 64, 65, 150):
            x = torch.randn(M, K)
            exact = x.double() @ dense.double().t() + bias.double()
            got = wk.weight_only_linear_cpu(x, w, bias, prefill_rows=0, split_rows=10 ** 6)
            ref = torch.nn.functional.linear(x, dense, bias)
            scale = exact.abs().max().item()
            err, err_ref = (got.double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item()
            assert err <= max(3 * err_ref, 1e-7 * scale) and err < 2e-6 * scale, (N, K, M, err, err_ref)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * scale)
    threads = torch.get_num_threads()
    try:   # blocks of weight rows across threads: each output is summed the same way
        torch.set_num_threads(2)
        assert torch.equal(wk.weight_only_linear_cpu(x, w, bias, prefill_rows=0, split_rows=10 ** 6), got)
    finally:
        torch.set_num_threads(threads)


BRGEMM = pytest.mark.skipif(not wk.brgemm_available(), reason="the fp32 brgemm path runs on AVX-512 CPUs only")


@BRGEMM
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_fp32_brgemm_path_is_an_fp32_product_of_the_reference_weight(fmt):
    """Decoded fp32 blocks (the reference's values) times x^T by oneDNN's fp32 brgemm: every format, against an
    fp64 product of the same decoded weight its error is within the bound of any fp32 summation order (and close
    to the reference's F.linear), on ragged shapes (odd K, N and M not multiples of 16, more than one 64-row block
    of x), with and without bias; the same result on two threads (each output is one brgemm sum whatever the
    blocks)."""
    for N, K in [(37, 203), (8, 256), (65, 96), (130, 520)]:
        _, w, dense = _layer(fmt, N, K)
        for bias in (torch.randn(N), None):
            for M in (3, 17, 64, 65, 150):
                x = torch.randn(M, K)
                exact = x.double() @ dense.double().t() + (0 if bias is None else bias.double())
                got = wk.weight_only_linear_cpu(x, w, bias, prefill_rows=0, split_rows=0, brgemm_rows=10 ** 6)
                ref = torch.nn.functional.linear(x, dense, bias)
                # any fp32 summation order: |error| <= (K + 1) u sum_k |x_k w_k| (+ the bias's rounding), u = 2^-24
                bound = (K + 1) * 2.0 ** -24 * (x.double().abs() @ dense.double().abs().t() + (
                    0 if bias is None else bias.double().abs()))
                err = (got.double() - exact).abs()
                assert bool((err <= bound).all()), (N, K, M, (err / bound).max().item())
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(wk.weight_only_linear_cpu(x, w, bias, prefill_rows=0, split_rows=0, brgemm_rows=10 ** 6),
                           got)
    finally:
        torch.set_num_threads(threads)


def test_fp32_brgemm_path_runs_where_measured_faster():
    """By default above the decode path's rows, where the split path does not run: up to 64 rows on K <= 64, 128
    below 512 k values, 256 up to 1 M values, 128 above up to K = 2048 and 64 beyond; on more than one thread up
    to 256 rows below 512 k values from K = 128."""
    assert [wk.brgemm_rows_for(N, K) for N, K in [(10, 128), (4096, 64), (192, 768), (512, 512), (1024, 512),
                                                  (1024, 1024), (4096, 1024), (1024, 4096)]] == [
        128, 64, 128, 128, 256, 256, 128, 64]
    assert [wk.brgemm_rows_for(N, K, threads=2) for N, K in [(10, 128), (4096, 64), (192, 768), (1024, 512)]] == [
        256, 64, 256, 256]
    _, w, _ = _layer(fm.IntFormat(4, 32), 192, 192)    # groups of 32: no split path on a small weight
    assert w.split_rows == 0 and w.brgemm_rows == 128 and w.brgemm_rows_threads == 256 and w.prefill_rows == 2
    threads = torch.get_num_threads()
    try:
        for n, rows in ((1, 128), (2, 256)):
            torch.set_num_threads(n)
            for M in (3, rows, rows + 1):
                x = torch.randn(M, 192)
                want = wk.weight_only_linear_cpu(x, w, prefill_rows=0, split_rows=0,
                                                 brgemm_rows=10 ** 6 if M <= rows else 0)
                assert torch.equal(wk.weight_only_linear_cpu(x, w), want), (n, M)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="brgemm_rows"):
        wk.weight_only_linear_cpu(torch.randn(2, 64), _layer(fm.IntFormat(4, 64), 8, 64)[1], brgemm_rows=-1)


def test_split_path_runs_only_where_it_is_exact_and_measured_faster():
    """Eligible: integer codes and integer-valued zero points (not NF4's table, not HQQ's real zeros); by default
    from 9 rows on weights of >= 0.5 M values, up to 2048 / 512 rows per channel (>= 1 M values / fewer), 512 with
    groups of >= 128, 128 with groups of 64, 32 with smaller ones from 4 M values; on smaller weights from K = 128
    and 32 output features, per channel or g >= 128, 256 / 512 rows (from 96 k values), g64 64 rows from 96 k
    values; never on K = 64, a few output features or small weights in groups of 32 (docs/kernels.md: 0.4-1.0x there).
    bf16 x: see `split_rows_for`."""
    assert not _layer(fm.NF4Format(64), 16, 64)[1].split_ok
    hqq = fm.IntFormat(4, 48, False, float_zero=True)
    t = fm.encode(torch.randn(16, 96), hqq)
    assert wk.pack(t, hqq, 96).split_ok          # zeros that happen to be integers: exact all the same
    assert not wk.pack({**t, "zero": t["zero"] + 0.25}, hqq, 96).split_ok
    assert _layer(fm.IntFormat(4, 64, symmetric=False), 16, 128)[1].split_ok
    rows = {(bits, group, N, K): _layer(fm.IntFormat(bits, group), N, K)[1].split_rows
            for bits, group, N, K in [(8, None, 768, 192), (8, None, 128, 256), (8, None, 256, 64), (8, None, 10, 128),
                                      (4, 128, 192, 192), (4, 64, 768, 192), (4, 64, 192, 192), (4, 32, 768, 192),
                                      (8, None, 1536, 384), (8, None, 1024, 1024), (4, 128, 1024, 1024),
                                      (4, 64, 1024, 1024), (4, 32, 1024, 1024), (4, 32, 2048, 2048)]}
    assert rows == {(8, None, 768, 192): 512, (8, None, 128, 256): 256, (8, None, 256, 64): 0, (8, None, 10, 128): 0,
                    (4, 128, 192, 192): 256, (4, 64, 768, 192): 64, (4, 64, 192, 192): 0, (4, 32, 768, 192): 0,
                    (8, None, 1536, 384): 512, (8, None, 1024, 1024): 2048, (4, 128, 1024, 1024): 512,
                    (4, 64, 1024, 1024): 128, (4, 32, 1024, 1024): 0, (4, 32, 2048, 2048): 32}
    # bf16 x: up to 16 rows on every eligible weight, 32 from 0.5 M values, 64 from 1 M per channel / g >= 128
    assert _layer(fm.IntFormat(8, None), 768, 192)[1].split_rows_bf16 == 16
    assert _layer(fm.IntFormat(8, None), 1536, 384)[1].split_rows_bf16 == 32
    assert _layer(fm.IntFormat(8, None), 1024, 1024)[1].split_rows_bf16 == 64
    assert _layer(fm.IntFormat(4, 64), 1024, 1024)[1].split_rows_bf16 == 32
    assert _layer(fm.NF4Format(64), 1024, 1024)[1].split_rows_bf16 == 0
    if wk.split_available():   # the default call at 40 rows of a 1 M-value weight is the split path's result
        _, w, _ = _layer(fm.IntFormat(8, None), 1024, 1024)
        for M in (9, 40, 2048):
            x = torch.randn(M, 1024)
            assert torch.equal(wk.weight_only_linear_cpu(x, w), wk.weight_only_linear_cpu(x, w, split_rows=10 ** 6))
            assert not torch.equal(wk.weight_only_linear_cpu(x, w), wk.weight_only_linear_cpu(x, w, split_rows=0))
        x = torch.randn(8, 1024)   # 8 rows and fewer: the decode path
        assert torch.equal(wk.weight_only_linear_cpu(x, w), wk.weight_only_linear_cpu(x, w, split_rows=0))
    with pytest.raises(ValueError, match="split_rows"):
        wk.weight_only_linear_cpu(torch.randn(2, 64), _layer(fm.IntFormat(4, 64), 8, 64)[1], split_rows=-1)


@SPLIT
@pytest.mark.parametrize("fmt", [fm.IntFormat(8, None), fm.IntFormat(4, 32, symmetric=False), fm.IntFormat(3, 24)],
                         ids=str)
def test_split_path_rounds_bf16_inputs_once(fmt):
    """bf16 x (one part): the exact products x (u - z) summed in fp32, scaled, rounded to bf16 once - each output
    within one bf16 rounding of the exact product (|err| <= 2^-8 |y| + fp32 noise), and never further from it than
    the reference's bf16 math (the weight rounded to bf16 first); ragged shapes, 9-16 rows (every weight) and 64."""
    for N, K in [(37, 203), (130, 520)]:
        _, w, dense = _layer(fmt, N, K)
        bias = torch.randn(N)
        for M in (9, 16, 64):
            x = torch.randn(M, K).bfloat16()
            got = wk.weight_only_linear_cpu(x, w, bias, split_rows=10 ** 6)
            assert got.dtype == torch.bfloat16 and got.shape == (M, N)
            exact = x.double() @ dense.double().t() + bias.bfloat16().double()   # the bias in x's dtype
            err = (got.double() - exact).abs()
            assert bool((err <= 2 ** -8 * exact.abs() + 1e-6 * exact.abs().max()).all()), (N, K, M, err.max())
            ref = torch.nn.functional.linear(x, dense.bfloat16(), bias.bfloat16())
            assert err.max() <= (ref.double() - exact).abs().max()
    if N * K < wk.SPLIT_MIN_VALUES:   # the default for a small weight: the split path up to 16 rows
        x = torch.randn(16, K).bfloat16()
        assert w.split_rows_bf16 == 16
        assert torch.equal(wk.weight_only_linear_cpu(x, w, bias), wk.weight_only_linear_cpu(x, w, bias,
                                                                                          split_rows=10 ** 6))


@SPLIT
@pytest.mark.parametrize("fmt", [fm.IntFormat(8, None), fm.IntFormat(4, 64, False, float_zero=True)], ids=str)
def test_amx_bf16_prefill_is_the_references_bf16_math(fmt):
    """bf16 x above the split path's rows, up to `AMX_BF16_ROWS`: the reference's bf16 math (weight rounded to
    bf16, fp32 sums, one rounding) with the decoded blocks packed for AMX - each output within one bf16 rounding
    of the exact product with the bf16 weight; N not a multiple of the 64-row blocks, M not of the 64-row A."""
    for N, K in [(100, 96), (130, 1024)]:
        _, w, dense = _layer(fmt, N, K)
        assert w.amx_ok
        bias = torch.randn(N)
        wb16 = dense.bfloat16()
        for M in (70, 256):
            x = torch.randn(M, K).bfloat16()
            got = wk.weight_only_linear_cpu(x, w, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (M, N)
            exact = x.double() @ wb16.double().t() + bias.bfloat16().double()
            err = (got.double() - exact).abs()
            assert bool((err <= 2 ** -8 * exact.abs() + 1e-5 * exact.abs().max()).all()), (N, K, M, err.max())
            amx = wk.load_extension().prefill_amx(x, w.qweight, w.scale, w.zero, w.bits, w.group_size,
                                                  bias.bfloat16().float())
            assert torch.equal(got, amx)   # the path the default call took
    assert not _layer(fm.NF4Format(64), 16, 64)[1].amx_ok and not _layer(fm.IntFormat(3, 24), 16, 48)[1].amx_ok


def test_split_table_smoke():
    """`bench_cpu --split`'s table: one row per shape, format and M with both paths and fp32 timed side by side;
    refused by name on a CPU without AMX (there would be no split path to compare)."""
    from workbench.benchmarks.kernels_cpu import split_table

    if not wk.split_available():
        with pytest.raises(RuntimeError, match="AMX"):
            split_table(shapes=((64, 64),), ms=(9,), rounds=1, formats=("int8",))
        return
    df = split_table(shapes=((64, 64), (32, 128)), ms=(9, 17), rounds=1, formats=("int8", "int4 g64"))
    assert len(df) == 8 and (df[["fp32_ms", "without_ms", "split_ms"]] > 0).all().all()
    # fp32 x on small weights: per channel from K = 128 and 32 output features, not with groups of 64 below 96 k
    assert dict(zip(zip(df["N"], df["format"]), df["default_rows"])) == {
        (64, "int8"): 0, (64, "int4 g64"): 0, (32, "int8"): 256, (32, "int4 g64"): 0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_bias_is_taken_in_xs_dtype_on_every_path(dtype):
    """As the reference takes it (F.linear in x's dtype): a float32 bias and the same bias rounded to x's dtype
    give bit-identical outputs whatever path the rows pick (decode, split, AMX bf16 prefill, GEMM)."""
    _, w, _ = _layer(fm.IntFormat(8, None), 1024, 1024)
    bias = torch.randn(1024)
    for M in (3, 12, 40, 300):
        x = torch.randn(M, 1024).to(dtype)
        assert torch.equal(wk.weight_only_linear_cpu(x, w, bias), wk.weight_only_linear_cpu(x, w, bias.to(dtype)))


@SPLIT
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")   # torch.backends.mkldnn.flags' own note
def test_split_path_over_several_weight_blocks_and_threads_and_with_mkldnn_off():
    """Several 256-row weight blocks across two threads give the one-thread result bit for bit; fp16 x goes through
    the fp32 split path; with oneDNN switched off at run time (torch.backends.mkldnn) the call takes the paths
    without AMX instead of failing."""
    _, w, dense = _layer(fm.IntFormat(4, 64, symmetric=False), 1100, 512)
    assert w.split_rows == 128
    x = torch.randn(70, 512)
    one = wk.weight_only_linear_cpu(x, w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(wk.weight_only_linear_cpu(x, w), one)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, x @ dense.t(), rtol=1e-5, atol=1e-5 * one.abs().max().item())
    h = x.half()
    assert torch.equal(wk.weight_only_linear_cpu(h, w), wk.weight_only_linear_cpu(h.float(), w).half())
    with torch.backends.mkldnn.flags(enabled=False):
        off = wk.weight_only_linear_cpu(x, w)
        assert torch.equal(off, wk.weight_only_linear_cpu(x, w, split_rows=0))
        assert wk.weight_only_linear_cpu(x.bfloat16(), w).dtype == torch.bfloat16


def test_split_eligibility_needs_every_code_minus_zero_exact_in_bf16():
    """|u - z| <= 256 for every 8-bit code: a zero point outside [-1, 256] is refused (u - z = 257 rounds)."""
    fmt = fm.IntFormat(8, 64, symmetric=False)
    t = fm.encode(torch.randn(16, 128), fmt)
    assert wk.pack(t, fmt, 128).split_ok
    w = wk.pack(t, fmt, 128)
    assert not wk.split_eligible(type(w)(w.qweight, w.scale, w.zero - 2 - w.zero.min(), None, 8, 64, 128))


@SPLIT
def test_amx_paths_on_a_hugging_face_gpt2_match_the_reference_kernel():
    """A model its author did not write: GPT-2 (Conv1D layers) 1024 wide, every Linear-like layer large enough for
    the AMX paths; at 2 x 20 tokens (40 rows) fp32 and bf16 logits match kernel="reference" (fp32: 1e-5 of the
    largest logit; bf16: 2e-2, one bf16 rounding per layer apart)."""
    import copy

    import transformers

    import workbench as wb

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=1024, n_layer=1, n_head=8, vocab_size=500,
                                                                 bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.randint(0, 500, (2, 20))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        base = copy.deepcopy(model).to(dtype)
        fast = wb.apply(base, {"*": wb.quant.WeightOnly(4, 128)}, progress=False)
        ref = wb.apply(base, {"*": wb.quant.WeightOnly(4, 128, kernel="reference")}, progress=False)
        layers = [m for m in fast.modules() if type(m).__name__ == "WeightOnlyLinear"]
        assert layers and all(m.kernel == "cpu" for m in layers)
        assert sum(m._cpu_weight().split_rows > 0 for m in layers) >= 4   # c_attn, c_proj, c_fc, mlp.c_proj
        with torch.inference_mode():
            a, b = fast(ids).logits.float(), ref(ids).logits.float()
        assert (a - b).abs().max() <= tol * b.abs().max(), (dtype, (a - b).abs().max())
