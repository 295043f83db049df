"""workbench_kernels/int8_weight_only.py: the Triton kernel against its PyTorch reference, the reference against the
package's `formats.decode`, input checks, and the ``workbench::int8_weight_only_mm`` custom op.

Without a GPU the kernel runs under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``),
so shapes are tiny; on a GPU the same tests run there (with the PTX conversion the interpreter replaces).
Tolerances are relative errors ``||y - ref|| / ||ref||`` against the fp32 reference:
1e-5 for fp32 activations (only the summation order differs), 2e-3 for fp16 and 1e-2 for bf16 (the codes
``u - 128`` are exact in both and x is already in that dtype: the error is the output's rounding).
"""

import numpy as np
import pytest
import torch

from workbench.quantization import formats as fm
from workbench_kernels import int8_weight_only as k8
from workbench_kernels._common import GEMV_M, INTERPRET, triton_available

DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton = pytest.mark.skipif(not triton_available(DEVICE), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FMT = fm.IntFormat(8, None, symmetric=True)

# (M, N, K): not multiples of the blocks; M = 70 is above SMALL_M
SHAPES = [(1, 16, 64), (3, 40, 96), (17, 40, 100), (70, 24, 64)]
# pinned blockings (valid on a GPU too): split-K into the fp32 buffer, and no split with a wider K-tile
CONFIGS = {"split-k": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2),
           "no-split": dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1)}


def make(M, N, K, dtype=torch.float32, bias=True, lead=(), seed=0):
    """Activations, the format's tensors from `fm.encode`, a bias."""
    gen = torch.Generator().manual_seed(seed)
    t = fm.encode(torch.randn(N, K, generator=gen), FMT)
    x = torch.randn(*lead, M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen) if bias else None
    args = (x.to(DEVICE), t["qweight"].to(DEVICE), t["scale"].to(DEVICE), None if b is None else b.to(DEVICE))
    return args, t


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm())


def test_format_is_what_the_kernel_reads():
    _, t = make(3, 16, 64)
    assert set(t) == {"qweight", "scale"}
    assert t["qweight"].dtype == torch.uint8 and t["qweight"].shape == (16, 64)
    assert t["scale"].dtype == torch.float16 and t["scale"].shape == (16, 1)


@pytest.mark.parametrize("M, N, K", SHAPES)
def test_reference_is_x_times_decoded_weight(M, N, K):
    (x, q, s, b), t = make(M, N, K)
    expected = x.float().cpu() @ fm.decode(t, FMT, K).T + b.cpu()
    torch.testing.assert_close(k8.reference(x.cpu(), q.cpu(), s.cpu(), b.cpu()), expected, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype, bias", [(torch.float32, True), (torch.float32, False), (torch.float16, True),
                                         (torch.float16, False), (torch.bfloat16, True)],
                         ids=["fp32-bias", "fp32", "fp16-bias", "fp16", "bf16-bias"])
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_kernel_matches_reference(M, N, K, dtype, bias, config):
    args, _ = make(M, N, K, dtype, bias)
    y = k8.launch(*args, config=CONFIGS[config])
    assert y.shape == (M, N) and y.dtype == dtype
    assert rel_err(y, k8.reference(*args)) <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("M", [3, 17, 70])  # the GEMV, decode (split-K) and prefill autotune families
def test_custom_op_with_autotuned_config(M):
    args, _ = make(M, 40, 96, torch.float16)
    assert rel_err(k8.int8_weight_only_mm(*args), k8.reference(*args)) <= TOL[torch.float16]


class _Spy:
    """Wraps an autotuned kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@needs_triton
@pytest.mark.parametrize("M, N, K, dtype, bias", [
    (1, 20, 100, torch.float32, True), (1, 37, 64, torch.float16, False), (1, 16, 130, torch.bfloat16, True),
    (2, 33, 96, torch.float16, True)], ids=["M1-fp32-bias", "M1-fp16", "M1-bf16-bias", "M2-fp16-bias"])
def test_gemv_path_for_few_rows(monkeypatch, M, N, K, dtype, bias):
    """M <= GEMV_M runs the GEMV kernel (N and K not multiples of its tiles), more rows the tl.dot kernel."""
    spy = _Spy(k8._kernel_gemv)
    monkeypatch.setattr(k8, "_kernel_gemv", spy)
    args, _ = make(M, N, K, dtype, bias)
    y = k8.launch(*args)
    assert spy.launches == (M <= GEMV_M) and y.shape == (M, N) and y.dtype == dtype
    assert rel_err(y, k8.reference(*args)) <= TOL[dtype]
    k8.launch(*make(GEMV_M + 1, N, K, dtype, bias)[0])          # one row more: the tl.dot kernel
    assert spy.launches == (M <= GEMV_M)


@needs_triton
def test_leading_batch_dims():
    (x, q, s, b), _ = make(3, 16, 64, lead=(2,))                      # x: (2, 3, 64)
    y = k8.int8_weight_only_mm(x, q, s, b)
    assert y.shape == (2, 3, 16)
    assert rel_err(y, k8.reference(x, q, s, b)) <= TOL[torch.float32]
    assert rel_err(y.reshape(6, 16), k8.int8_weight_only_mm(x.reshape(6, 64), q, s, b)) <= TOL[torch.float32]


def _bad(name):
    """Arguments of a valid call (M=3, N=16, K=64) with one of them broken."""
    (x, q, s, b), _ = make(3, 16, 64)
    args = dict(x=x, qweight=q, scale=s, bias=b)
    broken = {
        "x dtype": dict(x=x.to(torch.int8)),
        "x non-contiguous": dict(x=torch.randn(64, 3, device=DEVICE).T),
        "qweight dtype": dict(qweight=q.to(torch.int8)),
        "qweight non-contiguous": dict(qweight=q.T.contiguous().T),
        "K mismatch": dict(x=torch.randn(3, 96, device=DEVICE)),
        "scale shape": dict(scale=s.reshape(1, 16)),
        "scale dtype": dict(scale=s.to(torch.int32)),
        "bias shape": dict(bias=b[:8].contiguous()),
        "bias dtype": dict(bias=b.to(torch.int64)),
    }[name]
    return {**args, **broken}


@pytest.mark.parametrize("name, error, match", [
    ("x dtype", TypeError, "x must have dtype"),
    ("x non-contiguous", ValueError, "x must be contiguous"),
    ("qweight dtype", TypeError, "qweight must have dtype uint8"),
    ("qweight non-contiguous", ValueError, "qweight must be contiguous"),
    ("K mismatch", ValueError, r"qweight must have shape \(N, K\) with K = x.shape\[-1\] = 96"),
    ("scale shape", ValueError, r"scale must have shape \(16, 1\)"),
    ("scale dtype", TypeError, "scale must have dtype"),
    ("bias shape", ValueError, r"bias must have shape \(16\)"),
    ("bias dtype", TypeError, "bias must have dtype"),
])
def test_bad_input_names_the_argument(name, error, match):
    args = _bad(name)
    with pytest.raises(error, match=match):
        k8.int8_weight_only_mm(**args)
    meta = {k: v.to("meta") for k, v in args.items()}
    with pytest.raises(error, match=match):   # the fake implementation (torch.compile) checks the same
        k8.int8_weight_only_mm(**meta)


def test_bad_config_is_refused():
    args, _ = make(3, 16, 64)
    with pytest.raises(ValueError, match="config"):
        k8.launch(*args, config=dict(BLOCK_M=8, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1))
    with pytest.raises(ValueError, match="config"):
        k8.launch(*args, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32))


def test_fake_implementation_gives_the_output_shape():
    (x, q, s, b), _ = make(3, 16, 64, torch.float16, lead=(2,))
    y = k8.int8_weight_only_mm(x.to("meta"), q.to("meta"), s.to("meta"), b.to("meta"))
    assert y.shape == (2, 3, 16) and y.dtype == torch.float16 and y.device.type == "meta"


@needs_triton
@pytest.mark.parametrize("bias", [True, False])
def test_opcheck(bias):
    args, _ = make(2, 16, 64, bias=bias)
    torch.library.opcheck(torch.ops.workbench.int8_weight_only_mm.default, args)


@needs_triton
def test_torch_compile_fullgraph():
    x, q, s, b = make(3, 16, 64)[0]

    def f(x):
        return torch.relu(k8.int8_weight_only_mm(x, q, s, b)) + 1

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


def test_magic_constants_of_the_fast_conversion_are_exact():
    """The bit patterns `_codes_fast` builds: a code byte under the fp16 exponent byte 0x64 is 1024 + u, and
    1152 (0x6480) takes it to u - 128; under the fp32 exponent of 2^23 it is 2^23 + u, less 0x4B000080."""
    u = np.arange(256, dtype=np.uint32)
    half = ((0x64 << 8) | u).astype(np.uint16).view(np.float16)
    assert (half == 1024.0 + u).all()
    assert (half - np.array([0x6480], np.uint16).view(np.float16) == u.astype(np.float32) - 128).all()
    single = (0x4B000000 | u).view(np.float32)
    assert (single - np.array([0x4B000080], np.uint32).view(np.float32) == u.astype(np.float32) - 128).all()


# Compile for an H100 (sm_90) without a GPU: ptxas ships with Triton. This catches what the interpreter cannot
# see -- block shapes tl.dot rejects, dtype errors, the PTX of the fast conversion -- and checks that the weight
# and activation tiles are software-pipelined (asynchronous copies), which the decode speed depends on.
SM90_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workbench_kernels import int8_weight_only as k8

kernel, out = k8._int8_weight_only_mm_kernel, []
for case in json.loads(sys.argv[1]):
    xdt, small, index = case
    config = k8._autotune_configs(small)[index]
    consts = dict(HAS_BIAS=True, DOT_FP32=xdt == "fp32", FAST_UNPACK=xdt != "fp32", GROUP_M=8, stride_xk=1,
                  stride_wk=1, stride_sn=1, stride_cn=1, **config.kwargs)   # strides of 1 are specialized by the JIT
    types = dict(x_ptr="*" + xdt, w_ptr="*u8", scale_ptr="*fp16", bias_ptr="*fp16",
                 c_ptr="*fp32" if small else "*" + xdt)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    aligned = [(i,) for i, n in enumerate(kernel.arg_names) if n in types or n in ("N", "K", "stride_xm", "stride_wn")]
    c = triton.compile(ASTSource(kernel, sig, consts, {i: [["tt.divisibility", 16]] for i in aligned}),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    ttgir = c.asm["ttgir"]
    out.append(dict(case=case, config=config.kwargs, shared=c.metadata.shared, asm="elementwise_inline_asm" in ttgir,
                    async_copies=ttgir.count("async_copy_global_to_local")))
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_pipelined_tiles(compile_sm90):
    # (x dtype, decode family?, config index): bf16 and fp16 decode with the fast conversion, a bf16 prefill
    # (wgmma) config
    for r in compile_sm90(SM90_SCRIPT, [("bf16", True, 0), ("fp16", True, 1), ("bf16", False, 1)]):
        assert r["async_copies"] >= 2, r          # x and weight tiles both go through cp.async stages
        assert r["shared"] <= 227 * 1024, r       # fits an H100's shared memory per block
        assert r["asm"], r


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 16, 100])
def test_gpu_bf16_llama_shape(M):
    """bf16 on the GPU at a Llama MLP shape (autotuned; the first call per M bucket compiles every config)."""
    (x, q, s, _), _ = make(M, 4096, 4096, torch.bfloat16, bias=False)
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    y = k8.int8_weight_only_mm(x, q, s)
    assert y.dtype == torch.bfloat16 and y.is_cuda
    assert rel_err(y, k8.reference(x, q, s)) <= TOL[torch.bfloat16]
