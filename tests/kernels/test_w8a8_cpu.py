"""The CPU W8A8 kernel (workbench_kernels/w8a8_cpu.cpp): bit-identical to the PyTorch reference on every vector ISA this
CPU has, in every blocking (one block, many, ragged last block, split across threads, streamed stores), for
per-token and static activation scales; NaN rows stay NaN; bad input gets errors naming the argument; the
custom op traces under torch.compile."""
import pytest
import torch

from workbench.measurement import num_threads
from workbench_kernels import w8a8_cpu as wk

ORDER = ("scalar", "avx2", "avx512")


def supported_isas() -> list[str]:
    return list(ORDER[: ORDER.index(wk.cpu_isa()) + 1])


def operands(M, K, N, seed=0, static=False, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 3
    qweight_t = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g).t()   # the module's layout
    scale = torch.rand(1, N, generator=g) * 1e-2 + 1e-4
    b = torch.randn(N, generator=g) if bias else None
    act = torch.tensor(x.abs().max().item() / 100.0) if static else None              # some codes clip
    return x, qweight_t, scale, b, act


@pytest.mark.parametrize("isa", ORDER)
@pytest.mark.parametrize("M,K,N,block_rows", [(1, 200, 136, 0), (17, 7, 3, 0), (300, 200, 136, 64),
                                              (1100, 64, 48, 0), (2048, 40, 300, 0), (2048, 40, 300, 96)])
@pytest.mark.parametrize("static", [False, True])
def test_equals_the_reference_bit_for_bit(isa, M, K, N, block_rows, static):
    """(2048, 40, 300): a 2.4 MB output, written with non-temporal stores; with N = 300 most rows start at
    addresses where the vector stores fall back to ordinary ones. K = 7 / 40 exercise the scalar tails."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    x, w, s, b, act = operands(M, K, N, static=static, bias=M != 17)
    ref = wk.reference(x, w, s, b, act)
    assert torch.equal(wk.w8a8_linear_cpu(x, w, s, b, act, block_rows=block_rows, isa=isa), ref)


def test_threads_split_the_rows_and_give_the_same_numbers():
    x, w, s, b, _ = operands(3000, 96, 80)
    ref = wk.reference(x, w, s, b)
    for threads in (1, 2):
        with num_threads(threads):
            assert torch.equal(wk.w8a8_linear_cpu(x, w, s, b), ref)
            assert torch.equal(wk.w8a8_linear_cpu(x[:5], w, s, b), ref[:5])   # decode: the GEMM gets the threads


@pytest.mark.parametrize("static", [False, True])
def test_module_cpu_path_equals_its_reference_path_in_half_and_with_bad_rows(static):
    """After module.half() (scales and bias in fp16) and with NaN / Inf rows, kernel='cpu' and 'reference' of
    the same module agree: the same finite numbers, the same NaN rows."""
    from torch import nn

    from workbench.quantization.modules import W8A8Linear

    torch.manual_seed(0)
    lin = nn.Linear(48, 20)
    act = torch.tensor(0.03) if static else None
    ref = W8A8Linear.from_float(lin, act_scale=act).half()
    cpu = W8A8Linear.from_float(lin, act_scale=act, kernel="cpu").half()
    x = torch.randn(6, 48).half()
    x[2, 5], x[4, 0] = float("nan"), float("inf")
    with torch.no_grad():
        a, c = ref(x), cpu(x)
    torch.testing.assert_close(c, a, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(c[[2, 4]]).all() and torch.isfinite(c[[0, 1, 3, 5]]).all()


def test_module_compiles_with_grad_enabled():
    """torch.compile of a model holding kernel='cpu' layers traces the custom op (bias detached: no autograd
    formula is needed) and gives the eager numbers."""
    from torch import nn

    import workbench as wb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8))
    q = wb.apply(model, {"0": wb.quant.Dynamic(kernel="cpu"), "2": wb.quant.Dynamic(kernel="cpu")}, progress=False)
    x = torch.randn(5, 32)
    compiled = torch.compile(q, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), q(x))


def test_matches_the_module_reference_path_and_keeps_the_input_dtype():
    from torch import nn

    from workbench.quantization.modules import W8A8Linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 40)
    ref = W8A8Linear.from_float(lin)
    cpu = W8A8Linear.from_float(lin, kernel="cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, 5, 64).to(dtype)
        with torch.no_grad():
            y = cpu(x)
            assert y.dtype == dtype and y.shape == (3, 5, 40)
            assert torch.equal(y, ref(x))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_row_gives_a_nan_row_and_leaves_the_others_alone(static, bad):
    """On every ISA, whether the bad value falls in the vector body or the scalar tail (column 37 of 40)."""
    x, w, s, b, act = operands(40, 40, 24, static=static)
    x[3, 17] = bad
    x[9, 37] = bad
    keep = torch.ones(40, dtype=torch.bool)
    keep[[3, 9]] = False
    ref = wk.reference(x, w, s, b, act)
    assert torch.isnan(ref[~keep]).all()
    for isa in supported_isas():
        y = wk.w8a8_linear_cpu(x, w, s, b, act, isa=isa)
        assert torch.isnan(y[~keep]).all(), isa
        assert torch.equal(y[keep], ref[keep]), isa


def test_a_weight_without_a_unit_stride_is_copied_not_misread():
    x, w, s, b, _ = operands(20, 32, 24)
    expanded = torch.randint(-128, 128, (32, 1), dtype=torch.int8).expand(32, 24)   # stride (1, 0)
    strided = torch.randint(-128, 128, (64, 48), dtype=torch.int8)[::2, ::2]          # no unit stride
    for weight in (expanded, strided):
        assert torch.equal(wk.w8a8_linear_cpu(x, weight, s, b), wk.reference(x, weight, s, b))


def test_empty_inputs():
    _, w, s, b, _ = operands(1, 8, 4)
    assert wk.w8a8_linear_cpu(torch.empty(0, 8), w, s, b).shape == (0, 4)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.randint(0, 3, (4, 8))), "x must have dtype"),
    (dict(x=torch.randn(4, 9)), "x has K = 9 columns but qweight_t"),
    (dict(w=torch.zeros(8, 6, dtype=torch.int32)), "qweight_t must have dtype int8"),
    (dict(s=torch.ones(1, 5)), "scale must hold one value per output column"),
    (dict(s=torch.ones(1, 6, dtype=torch.float64)), "scale must have dtype float32"),
    (dict(b=torch.ones(5)), "bias must have shape"),
    (dict(act=torch.ones(2)), "act_scale must be one value"),
    (dict(block_rows=-1), "block_rows must be an int >= 0"),
    (dict(isa="neon"), "isa must be one of"),
])
def test_bad_input_names_the_argument(change, match):
    x, w, s, b, _ = operands(4, 8, 6)
    args = dict(x=x, w=w, s=s, b=b, act=None, block_rows=0, isa="auto") | change
    with pytest.raises((TypeError, ValueError), match=match):
        wk.w8a8_linear_cpu(args["x"], args["w"], args["s"], args["b"], args["act"], block_rows=args["block_rows"],
                           isa=args["isa"])


def test_a_failed_build_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(wk, "_build", lambda: (None, RuntimeError("Error building extension\nc++: not found")))
    x, w, s, b, _ = operands(4, 8, 6)
    with pytest.raises(RuntimeError, match="needs ninja and a working C\\+\\+ compiler.*c\\+\\+: not found.*"
                                           "kernel='reference'"):
        wk.w8a8_linear_cpu(x, w, s, b)


def test_opcheck_and_compile():
    x, w, s, b, act = operands(6, 16, 8, static=True)
    op = torch.ops.workbench.w8a8_linear_cpu.default
    torch.library.opcheck(op, (x, w, s, b, None))
    torch.library.opcheck(op, (x, w, s, None, act))

    def fn(x):
        return wk.w8a8_linear_cpu(x, w, s, b).relu()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), fn(x))


def test_the_pip_ninja_is_found_without_an_activated_venv(monkeypatch):
    """make test runs .venv/bin/python without activating the venv: the ninja that pip installed there must be
    put on PATH for torch.utils.cpp_extension when no other ninja is."""
    import os

    import ninja

    monkeypatch.setattr(wk.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    wk._ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR


def test_a_built_extension_is_recognised_so_no_compile_notice_is_printed():
    wk.load_extension()
    assert wk._looks_built()
