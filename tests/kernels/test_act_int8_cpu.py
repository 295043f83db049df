"""workbench_kernels.act_int8_cpu (``WeightOnly(kernel="cpu-int8")``): 4- / 8-bit codes times activations rounded
to int8 per block of 32, against its fp64 PyTorch reference - every zero-point kind, groups that do not fill the
64-byte chunks (32, 96, 160, a short last group, per channel), rows of x 1-6, each ISA this CPU has, threads; the
rounding itself against an independent statement of it; the module path (decode and prefill give the same
numbers) and bad input refused by name."""
import pytest
import torch

import workbench as wb
from workbench.quantization import formats as fm
from workbench.quantization.modules import WeightOnlyLinear
from workbench_kernels import act_int8_cpu as ak

ISAS = ["scalar", "avx2", "avx512"][:("scalar", "avx2", "avx512").index(ak.cpu_isa()) + 1]   # those this CPU has
FORMATS = [fm.IntFormat(4, 32), fm.IntFormat(4, 96, symmetric=False), fm.IntFormat(4, 64, False, float_zero=True),
           fm.IntFormat(8, 32), fm.IntFormat(8, None, symmetric=False), fm.IntFormat(3, 32), fm.IntFormat(4, None)]


def _weight(fmt, N, K, seed=0):
    t = fm.encode(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)), fmt)
    return (t["qweight"], t["scale"], t.get("zero"), fmt.slot_bits, fmt.group_size, K)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_matches_the_fp64_reference(fmt, isa):
    for N, K in [(37, 224), (8, 160), (70, 512)]:
        if fmt.group_size and fmt.group_size > K:
            continue
        w = _weight(fmt, N, K)
        bias = torch.randn(N)
        for M in (1, 2, 3, 4, 6):
            x = torch.randn(M, K) * torch.linspace(0.1, 10, K)      # blocks of very different ranges
            expected = ak.reference(x, *w, bias).double()
            got = ak.linear(x, *w, bias, isa=isa).double()
            # fp32 sums of K products: within a few fp32 roundings of the sum of the magnitudes
            bound = 4e-7 * K ** 0.5 * (ak.round_activations(x).abs().double() @
                                       ak.reference(torch.eye(K), *w).double().abs()).max()
            assert (got - expected).abs().max() <= bound + 1e-6, (fmt, isa, N, K, M)


def test_the_rounding_is_per_block_of_32_to_nearest_even():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 5] = 0.5 / 127                      # exactly half a step above zero: rounds to 0 (even)
    x[0, 6] = 1.5 / 127                      # 1.5 steps: rounds to 2
    x[1, 40] = -3.0                          # the block's largest magnitude maps to -127
    r = ak.round_activations(x)
    d0 = 1.0 / 127
    assert r[0, 5] == 0 and torch.isclose(r[0, 6], torch.tensor(2 * d0))
    assert torch.equal(r[0, 32:], torch.zeros(32))                   # an all-zero block stays zero
    assert torch.isclose(r[1, 40], torch.tensor(-3.0)) and torch.equal(r[1, :32], torch.zeros(32))
    steps = r[0, :32] / d0
    assert torch.equal(steps, steps.round()) and steps.abs().max() == 127
    assert torch.equal(ak.round_activations_cpu(x * 7.3), ak.round_activations(x * 7.3))
    big = torch.randn(5, 96) * 100
    assert torch.equal(ak.round_activations_cpu(big), ak.round_activations(big))
    ties = torch.randn(400, 64, generator=torch.Generator().manual_seed(0)).bfloat16().float()   # many exact ties
    ties[:, 0] = ties[:, 2:32].abs().amax(dim=1) * 2 * torch.sign(ties[:, 0])   # the block's largest
    ties[:, 1] = ties[:, 0] / 2                   # x = amax / 2: x * fp32(127 / amax) lands on either side of 63.5
    assert torch.equal(ak.round_activations_cpu(ties), ak.round_activations(ties))


@pytest.mark.parametrize("isa", ISAS)
def test_buffers_kept_between_calls_change_nothing(isa):
    """The kernel keeps each thread's rounded rows of x and each shape's chunk layout between calls: calls of other
    shapes, formats and row counts in between (fewer rows, a shorter K, more rows than it keeps) give each call
    exactly what it gives alone, and many rows give what the rows give one at a time."""
    calls = []
    for fmt, N, K, M in [(fm.IntFormat(4, 32), 40, 512, 3), (fm.IntFormat(8, 32), 24, 96, 1),
                         (fm.IntFormat(4, 96, symmetric=False), 33, 288, 70), (fm.IntFormat(4, 32), 40, 512, 1),
                         (fm.IntFormat(8, None, symmetric=False), 8, 160, 5)]:
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K))
        calls.append((x, _weight(fmt, N, K)))
    alone = [ak.linear(x, *w, isa=isa) for x, w in calls]
    for _ in range(2):
        for (x, w), expected in zip(reversed(calls), reversed(alone)):
            assert torch.equal(ak.linear(x, *w, isa=isa), expected)
    x, w = calls[2]   # 70 rows: more than the kernel keeps per thread
    assert torch.equal(torch.cat([ak.linear(x[i:i + 1], *w, isa=isa) for i in range(len(x))]), alone[2])


@pytest.mark.parametrize("isa", ISAS)
def test_threads_do_not_change_the_result(isa):
    w = _weight(fm.IntFormat(4, 32), 600, 512)
    x = torch.randn(3, 512)
    one = ak.linear(x, *w, isa=isa)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(ak.linear(x, *w, isa=isa), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_return_their_dtype(dtype):
    w = _weight(fm.IntFormat(4, 32), 16, 64)
    x = torch.randn(2, 3, 64)
    y = ak.linear(x.to(dtype), *w)
    assert y.dtype == dtype and y.shape == (2, 3, 16)
    torch.testing.assert_close(y.float(), ak.reference(x.to(dtype).float(), *w).float(), rtol=1e-2, atol=1e-2)


def test_bad_input_is_refused_by_name():
    w = _weight(fm.IntFormat(4, 32), 16, 64)
    with pytest.raises(ValueError, match="K = 64"):
        ak.linear(torch.randn(2, 63), *w)
    with pytest.raises(TypeError, match="float32"):
        ak.linear(torch.ones(2, 64, dtype=torch.int32), *w)
    with pytest.raises(ValueError, match="2-bit code slots"):
        ak.linear(torch.randn(2, 64), w[0], w[1], None, 2, 32, 64)
    with pytest.raises(ValueError, match="group_size 48"):
        ak.linear(torch.randn(2, 96), w[0], w[1], None, 4, 48, 96)
    with pytest.raises(ValueError, match="fp16"):
        ak.linear(torch.randn(2, 64), w[0], w[1].float(), None, 4, 32, 64)
    with pytest.raises(ValueError, match="isa"):
        ak.linear(torch.randn(2, 64), *w, isa="neon")


def _model(kernel):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    return m, wb.apply(m, {"*": wb.quant.WeightOnly(bits=4, group_size=32, kernel=kernel)}, progress=False)


def test_module_rounds_activations_on_every_path():
    base, q = _model("cpu-int8")
    _, exact = _model("auto")
    assert all(m.kernel == "cpu-int8" for m in q.modules() if hasattr(m, "kernel"))
    x = torch.randn(40, 64)                                   # 40 rows: the prefill path on the rounded x
    with torch.inference_mode():
        rows = torch.cat([q(x[i:i + 1]) for i in range(40)])   # one row at a time: the int8 dot product
        whole = q(x)
        # what it computes: every Linear's input rounded, times its stored weight
        h = ak.reference(x, *_weight_of(q[0]), q[0].bias)
        expected = ak.reference(torch.nn.functional.gelu(h), *_weight_of(q[2]), q[2].bias)
        torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows, whole, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(whole, exact(x), rtol=0, atol=1e-6)   # it does round (not the exact kernel)
        assert torch.nn.functional.cosine_similarity(whole.flatten(), exact(x).flatten(), 0) > 0.999


def _weight_of(m):
    return (m.qweight, m.scale, getattr(m, "zero", None), m.fmt.slot_bits, m.fmt.group_size, m.K)


def test_module_refuses_formats_it_cannot_take_naming_the_layer():
    m = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 8))
    with pytest.raises(wb.ApplyError, match=r"'1'.*K = 8 is not a multiple of 32"):
        wb.apply(m, {"*": wb.quant.WeightOnly(bits=4, group_size=None, kernel="cpu-int8")}, progress=False)
    with pytest.raises(ValueError, match="no integer codes"):
        WeightOnlyLinear.from_float(m[0], fm.NF4Format(32), kernel="cpu-int8")
    with pytest.raises(wb.ApplyError, match=r"'0'.*2-bit code slots"):
        wb.apply(m, {"*": wb.quant.WeightOnly(bits=2, group_size=32, kernel="cpu-int8")}, progress=False)


def test_saved_and_loaded_keeps_the_kernel(tmp_path):
    base, q = _model("cpu-int8")
    wb.save(q, tmp_path / "m")
    back = wb.load(tmp_path / "m", base=base)
    assert back[0].kernel == "cpu-int8"
    x = torch.randn(2, 64)
    with torch.inference_mode():
        assert torch.equal(back(x), q(x))


def test_gemv_table_smoke():
    from workbench.benchmarks.kernels_cpu import gemv_table

    df = gemv_table(shapes=((64, 128),), formats=((4, 32),), rounds=2, bandwidth_gib=0.01)
    assert list(df["path"]) == ["fp32", "bf16", "int4 g32 cpu", "int4 g32 cpu-int8"]
    assert (df["ms"] > 0).all() and (df["GB_s"] > 0).all() and (df["bandwidth_GB_s"] > 0).all()
    codes_and_fp16_scales = 64 * 128 // 2 + 64 * 4 * 2
    assert df.set_index("path").loc["int4 g32 cpu-int8", "weight_bytes"] == codes_and_fp16_scales


def test_a_failed_build_names_the_kernel_and_the_compilers_line():
    from workbench_kernels._common import extension_or_raise

    err = RuntimeError("Error building extension 'x'\nfoo.cpp:3: error: 'bar' was not declared\nninja: stopped")
    with pytest.raises(RuntimeError, match=r"^act_int8_linear_cpu: the CPU int8-activation kernel is C\+\+ compiled "
                                           r".* foo.cpp:3: error: 'bar' was not declared\. Use kernel='reference' or "
                                           r"'cpu' on this machine\.$"):
        extension_or_raise((None, err), "act_int8_linear_cpu", "CPU int8-activation kernel",
                           "kernel='reference' or 'cpu'")
    assert extension_or_raise(("module", None), "op", "kernel") == "module"
