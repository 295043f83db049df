"""workbench_kernels/int4_weight_only.py: the Triton kernel against its PyTorch reference, the reference against the
package's `formats.decode`, input checks, and the ``workbench::int4_weight_only_mm`` custom op.

Without a GPU the kernel runs under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``),
so shapes are tiny; on a GPU the same tests run there (with the PTX unpacking the interpreter replaces).
Tolerances are relative errors ``||y - ref|| / ||ref||`` against the fp32 reference: 1e-5 for fp32 activations
(only the summation order differs), 2e-3 for fp16 (operands rounded to fp16 for ``tl.dot`` -- ``u - z`` is
exact for integer zero points, weights with float zeros or gathered scales are not -- then the output), 1e-2
for bf16 (the same with 8 mantissa bits).
"""

import numpy as np
import pytest
import torch

from workbench.quantization import formats as fm
from workbench_kernels import int4_weight_only as k4
from workbench_kernels._common import INTERPRET, triton_available

DEVICE = "cpu" if INTERPRET else "cuda"
needs_triton = pytest.mark.skipif(not triton_available(DEVICE), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# zero-point storage: symmetric (no tensor, zero = 8), uint8 codes, HQQ's fp16 float zeros
MODES = {"symmetric": dict(symmetric=True), "uint8-zero": dict(symmetric=False),
         "float-zero": dict(symmetric=False, float_zero=True)}
# (M, N, K, g): not multiples of the blocks; g = 24 and 21 are not multiples of BLOCK_K (gathered scales);
# K = 63 is odd (the last byte holds one code); M = 70 is above SMALL_M
SHAPES = [(1, 16, 64, 32), (3, 40, 96, 32), (17, 40, 128, 64), (3, 16, 96, 24), (2, 16, 63, 21), (70, 40, 64, 64)]
# pinned blockings (valid on a GPU too): split-K into the fp32 buffer; a K-tile wider than g = 32; and
# BLOCK_M > BLOCK_K, where the scale multiplies the weights rather than the partial product
CONFIGS = {"split-k": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2),
           "no-split": dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1),
           "tall": dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)}


def make(M, N, K, g, mode, dtype=torch.float32, bias=True, lead=(), seed=0):
    """Activations, the format's tensors from `fm.encode`, a bias, and the format."""
    gen = torch.Generator().manual_seed(seed)
    fmt = fm.IntFormat(4, g, **MODES[mode])
    t = fm.encode(torch.randn(N, K, generator=gen), fmt)
    x = torch.randn(*lead, M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen) if bias else None
    dev = {name: v.to(DEVICE) for name, v in t.items()}
    args = (x.to(DEVICE), dev["qweight"], dev["scale"], dev.get("zero"), g, None if b is None else b.to(DEVICE))
    return args, t, fmt


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M, N, K, g", SHAPES[:3] + SHAPES[4:5])
def test_reference_is_x_times_decoded_weight(M, N, K, g, mode):
    (x, q, s, z, g, b), t, fmt = make(M, N, K, g, mode)
    expected = x.float().cpu() @ fm.decode(t, fmt, K).T + b.cpu()
    torch.testing.assert_close(k4.reference(x.cpu(), q.cpu(), s.cpu(), None if z is None else z.cpu(), g, b.cpu()),
                               expected, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("config, dtype, bias", [  # every config and every dtype twice, not all combinations
    ("split-k", torch.float32, True), ("split-k", torch.float16, False), ("no-split", torch.bfloat16, True),
    ("no-split", torch.float32, False), ("tall", torch.float16, True), ("tall", torch.bfloat16, False)],
    ids=["split-k-fp32-bias", "split-k-fp16", "no-split-bf16-bias", "no-split-fp32", "tall-fp16-bias", "tall-bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M, N, K, g", SHAPES)
def test_kernel_matches_reference(M, N, K, g, mode, dtype, bias, config):
    args, _, _ = make(M, N, K, g, mode, dtype, bias)
    y = k4.launch(*args, config=CONFIGS[config])
    assert y.shape == (M, N) and y.dtype == dtype
    assert rel_err(y, k4.reference(*args)) <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("M", [3, 70])  # the decode (split-K) and the prefill autotune families
def test_custom_op_with_autotuned_config(M):
    args, _, _ = make(M, 40, 96, 32, "uint8-zero", torch.float16)
    assert rel_err(k4.int4_weight_only_mm(*args), k4.reference(*args)) <= TOL[torch.float16]


@needs_triton
def test_leading_batch_dims():
    (x, q, s, z, g, b), _, _ = make(3, 16, 64, 32, "float-zero", lead=(2,))   # x: (2, 3, 64)
    y = k4.int4_weight_only_mm(x, q, s, z, g, b)
    assert y.shape == (2, 3, 16)
    assert rel_err(y, k4.reference(x, q, s, z, g, b)) <= TOL[torch.float32]
    assert rel_err(y.reshape(6, 16), k4.int4_weight_only_mm(x.reshape(6, 64), q, s, z, g, b)) <= TOL[torch.float32]


def _bad(name):
    """Arguments of a valid call (M=3, N=16, K=64, g=32, uint8 zeros) with one of them broken."""
    (x, q, s, z, g, b), _, _ = make(3, 16, 64, 32, "uint8-zero")
    args = dict(x=x, qweight=q, scale=s, zero=z, group_size=g, bias=b)
    broken = {
        "x dtype": dict(x=x.to(torch.int32)),
        "x non-contiguous": dict(x=torch.randn(64, 3, device=DEVICE).T),
        "qweight dtype": dict(qweight=q.to(torch.int8)),
        "qweight non-contiguous": dict(qweight=q.T.contiguous().T),
        "K mismatch": dict(x=torch.randn(3, 96, device=DEVICE)),
        "group_size does not divide K": dict(group_size=24),
        "scale shape": dict(scale=s[:, :1].contiguous()),
        "scale dtype": dict(scale=s.to(torch.int32)),
        "zero shape": dict(zero=z[:8].contiguous()),
        "bias shape": dict(bias=b[:8].contiguous()),
    }[name]
    return {**args, **broken}


@pytest.mark.parametrize("name, error, match", [
    ("x dtype", TypeError, "x must have dtype"),
    ("x non-contiguous", ValueError, "x must be contiguous"),
    ("qweight dtype", TypeError, "qweight must have dtype uint8"),
    ("qweight non-contiguous", ValueError, "qweight must be contiguous"),
    ("K mismatch", ValueError, r"qweight must have shape \(N, ceil\(K / 2\)\)"),
    ("group_size does not divide K", ValueError, "group_size must be a positive int dividing K"),
    ("scale shape", ValueError, r"scale must have shape \(16, 2\)"),
    ("scale dtype", TypeError, "scale must have dtype"),
    ("zero shape", ValueError, r"zero must have shape \(16, 2\)"),
    ("bias shape", ValueError, r"bias must have shape \(16\)"),
])
def test_bad_input_names_the_argument(name, error, match):
    args = _bad(name)
    with pytest.raises(error, match=match):
        k4.int4_weight_only_mm(**args)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(error, match=match):   # the fake implementation (torch.compile) checks the same
        k4.int4_weight_only_mm(**meta)



def test_bad_config_is_refused():
    args, _, _ = make(3, 16, 64, 32, "symmetric")
    with pytest.raises(ValueError, match=r"config\['BLOCK_K'\] must be a power of two >= 32"):
        k4.launch(*args, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=1))
    with pytest.raises(ValueError, match="config must be a dict with keys"):
        k4.launch(*args, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, GROUP_M=4))

def test_fake_implementation_gives_the_output_shape():
    (x, q, s, z, g, b), _, _ = make(3, 16, 64, 32, "float-zero", torch.bfloat16, lead=(2,))
    y = k4.int4_weight_only_mm(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in (x, q, s, z, g, b)))
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16 and y.device.type == "meta"


@needs_triton
@pytest.mark.parametrize("mode", ["symmetric", "uint8-zero"])
def test_opcheck(mode):
    args, _, _ = make(2, 16, 64, 32, mode, bias=mode == "symmetric")
    torch.library.opcheck(torch.ops.workbench.int4_weight_only_mm.default, args)


@needs_triton
def test_torch_compile_fullgraph():
    x, q, s, z, g, b = make(3, 16, 64, 32, "float-zero")[0]

    def f(x):
        return torch.relu(k4.int4_weight_only_mm(x, q, s, z, g, b)) + 1

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


def test_magic_constants_of_the_fast_unpacking_are_exact():
    """The bit patterns `_unpack_nibbles_fast` builds: a 4-bit code in the low mantissa bits of 1024 (fp16) or
    128 (bf16) is exactly 1024 + code / 128 + code, and the packed FMA constants are 1.0 and -M."""
    codes = np.arange(16, dtype=np.uint32)
    assert ((codes | 0x6400).astype(np.uint16).view(np.float16) == 1024.0 + codes).all()
    assert (((codes | 0x4300) << 16).view(np.float32) == 128.0 + codes).all()   # bf16 = fp32's top 16 bits
    assert np.array([0x3C00, 0xE400], np.uint16).view(np.float16).tolist() == [1.0, -1024.0]
    assert (np.array([0x3F80, 0xC300], np.uint32) << 16).view(np.float32).tolist() == [1.0, -128.0]


# Compile for an H100 (sm_90) without a GPU: ptxas ships with Triton. This catches what the interpreter cannot
# see -- block shapes tl.dot rejects, dtype errors, the PTX of the fast unpacking -- and checks that the weight
# and activation tiles are software-pipelined (asynchronous copies), which the decode speed depends on.
SM90_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workbench_kernels import int4_weight_only as k4

kernel, out = k4._int4_weight_only_mm_kernel, []
for case in json.loads(sys.argv[1]):
    xdt, g, zero, small, index = case
    config = k4._autotune_configs(small)[index]
    lut = zero == "lut"                                                  # a table format (E2M1 codes)
    consts = dict(GROUP_SIZE=g, HAS_ZERO=zero not in ("none", "lut"), HAS_BIAS=True, DOT_FP32=xdt == "fp32",
                  FAST_UNPACK=xdt != "fp32", HAS_LUT=lut, GROUP_M=8, stride_xk=1, stride_wj=1, stride_sg=1,
                  stride_cn=1, **config.kwargs)                          # strides of 1 are specialized by the JIT
    types = dict(x_ptr="*" + xdt, w_ptr="*u8", scale_ptr="*fp32" if lut else "*fp16",
                 zero_ptr="*" + zero.replace("none", "fp16").replace("lut", "fp16"), bias_ptr="*fp16",
                 c_ptr="*fp32" if small else "*" + xdt, lut_ptr="*fp32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    aligned = [(i,) for i, n in enumerate(kernel.arg_names)
               if n in types or n in ("N", "K", "KP", "stride_xm", "stride_wn")]
    c = triton.compile(ASTSource(kernel, sig, consts, {i: [["tt.divisibility", 16]] for i in aligned}),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    ttgir = c.asm["ttgir"]
    out.append(dict(case=case, config=config.kwargs, shared=c.metadata.shared, asm="elementwise_inline_asm" in ttgir,
                    async_copies=ttgir.count("async_copy_global_to_local")))
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_pipelined_tiles(compile_sm90):
    # (x dtype, g, zero dtype, decode family?, config index): bf16 decode with the fast unpacking, fp16 with a
    # K-tile spanning groups (gathered scales; odd g), and a prefill (wgmma) config
    # and the E2M1 table (MXFP4 / NVFP4: fp32 block scales) on the decode and prefill families
    cases = [("bf16", 128, "u8", True, 0), ("fp16", 21, "fp16", True, 1), ("bf16", 64, "none", False, 1),
             ("bf16", 32, "lut", True, 6), ("fp16", 16, "lut", False, 0)]
    for r in compile_sm90(SM90_SCRIPT, cases):
        assert r["async_copies"] >= 2, r          # x and weight tiles both go through cp.async stages
        assert r["shared"] <= 227 * 1024, r       # fits an H100's shared memory per block
        one_group = r["case"][1] % r["config"]["BLOCK_K"] == 0
        assert r["asm"] == (one_group and r["case"][2] != "lut"), r   # fast unpacking on the one-group integer path


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 16, 100])
def test_gpu_bf16_llama_shape(M):
    """bf16 on the GPU at a Llama MLP shape (autotuned; the first call per M bucket compiles every config)."""
    (x, q, s, z, g, b), _, _ = make(M, 4096, 4096, 128, "uint8-zero", torch.bfloat16, bias=False)
    x, q, s, z = (t.cuda() for t in (x, q, s, z))
    y = k4.int4_weight_only_mm(x, q, s, z, g)
    assert y.dtype == torch.bfloat16 and y.is_cuda
    assert rel_err(y, k4.reference(x, q, s, z, g)) <= TOL[torch.bfloat16]


# ---- table formats: E2M1 codes (MXFP4: E8M0 scales per 32, NVFP4: e4m3 per 16 and a tensor scale) --------------
TABLE_FORMATS = {"mxfp4": fm.MXFP4Format(), "nvfp4": fm.NVFP4Format()}


def make_table(M, N, K, name, dtype=torch.float32, bias=True, seed=0):
    """Arguments of the table call: x, codes, the format's fp32 block scales, no zero, its block, bias, the table."""
    gen = torch.Generator().manual_seed(seed)
    fmt = TABLE_FORMATS[name]
    t = fm.encode(torch.randn(N, K, generator=gen), fmt)
    scale, zero, lut = fmt.triton_tensors(t)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen) if bias else None
    args = (x.to(DEVICE), t["qweight"].to(DEVICE), scale.to(DEVICE), zero, fmt.group_size,
            None if b is None else b.to(DEVICE))
    return args, lut.to(DEVICE), t, fmt


@pytest.mark.parametrize("name", TABLE_FORMATS)
def test_table_reference_is_x_times_the_formats_decoded_weight(name):
    (x, q, s, z, g, b), lut, t, fmt = make_table(3, 40, 96, name)
    expected = x.float().cpu() @ fm.decode(t, fmt, 96).T + b.cpu()
    torch.testing.assert_close(k4.reference(x, q, s, z, g, b, lut=lut), expected, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("config, dtype", [("split-k", torch.float32), ("no-split", torch.float16),
                                           ("tall", torch.bfloat16), ("tall", torch.float32)])
@pytest.mark.parametrize("name", TABLE_FORMATS)
@pytest.mark.parametrize("M, N, K", [(1, 16, 64), (3, 40, 96), (70, 40, 128)])
def test_table_kernel_matches_reference(M, N, K, name, dtype, config):
    """MXFP4 (blocks of 32: one group per K-tile of 32, tiles of 64 span two) and NVFP4 (blocks of 16: every K-tile
    spans groups, gathered scales) through both decode paths of the kernel."""
    args, lut, _, _ = make_table(M, N, K, name, dtype)
    y = k4.launch(*args, config=CONFIGS[config], lut=lut)
    assert y.shape == (M, N) and y.dtype == dtype
    assert rel_err(y, k4.reference(*args, lut=lut)) <= TOL[dtype]


@needs_triton
def test_table_custom_op_and_module_path():
    args, lut, _, _ = make_table(3, 40, 96, "nvfp4", torch.float16)
    assert rel_err(k4.int4_weight_only_mm(*args, lut=lut), k4.reference(*args, lut=lut)) <= TOL[torch.float16]
    torch.library.opcheck(torch.ops.workbench.int4_weight_only_mm.default, args + (lut,))
    from torch import nn

    from workbench.quantization.modules import WeightOnlyLinear

    lin = nn.Linear(64, 24).to(DEVICE)
    for fmt in TABLE_FORMATS.values():
        layer = WeightOnlyLinear.from_float(lin, fmt, kernel="triton")
        x = torch.randn(5, 64, device=DEVICE)
        with torch.no_grad():
            ref = nn.functional.linear(x, layer.dequantized_weight(), lin.bias)
            assert rel_err(layer(x), ref) <= TOL[torch.float32]


def test_table_inputs_are_checked():
    args, lut, _, _ = make_table(3, 16, 64, "mxfp4")
    with pytest.raises(ValueError, match="lut"):
        k4.int4_weight_only_mm(*args, lut=lut[:8])
    x, q, s, _, g, b = args
    with pytest.raises(ValueError, match="no zero points"):
        k4.int4_weight_only_mm(x, q, s, torch.zeros_like(s, dtype=torch.uint8), g, b, lut=lut)
