"""Weight formats as objects: each class implements the whole protocol (encode / empty / decode / validate and
its kernels), the registry holds them, and a format defined outside the package works in a quantized module
without touching anything else."""
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from workbench.quantization import formats as fm
from workbench.quantization.modules import WeightOnlyLinear

FORMATS = [fm.IntFormat(4, 32), fm.IntFormat(3, 24, symmetric=False), fm.IntFormat(4, 48, False, float_zero=True),
           fm.IntFormat(8, None), fm.IntFormat(2, 16), fm.NF4Format(64), fm.NF4Format(None), fm.FP8Format(),
           fm.FP8Format(torch.float8_e5m2), fm.MXFP4Format(), fm.NVFP4Format(), fm.MXFP8Format()]
# worst relative weight error of round-to-nearest on Gaussian weights, per format (loose bounds; a broken
# decode gives errors of order 1)
MAX_ERR = {"int": {2: 0.6, 3: 0.3, 4: 0.2, 8: 0.01}, "nf4": 0.2, "fp8": 0.1, "mxfp4": 0.2, "nvfp4": 0.2, "mxfp8": 0.1}


def test_registry_holds_each_format_class_once():
    assert fm.FORMATS == {"int": fm.IntFormat, "nf4": fm.NF4Format, "fp8": fm.FP8Format, "mxfp4": fm.MXFP4Format,
                          "nvfp4": fm.NVFP4Format, "mxfp8": fm.MXFP8Format}
    assert all(issubclass(c, fm.WeightFormat) for c in fm.FORMATS.values())
    with pytest.raises(ValueError, match="'nf4' is taken by NF4Format"):
        fm.register_format(type("Other", (fm.NF4Format,), {"name": "nf4"}))


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_encode_matches_empty_and_decodes_close(fmt):
    w = torch.randn(40, 100, generator=torch.Generator().manual_seed(0))   # 100: short last groups
    t = fm.encode(w, fmt)
    expected = fm.empty(tuple(w.shape), fmt, device="meta")
    assert {k: (v.shape, v.dtype) for k, v in t.items()} == {k: (v.shape, v.dtype) for k, v in expected.items()}
    back = fm.decode(t, fmt, 100)
    assert back.shape == w.shape and back.dtype == torch.float32
    err = float((back - w).norm() / w.norm())
    bound = MAX_ERR[fmt.name][fmt.bits] if fmt.name == "int" else MAX_ERR[fmt.name]
    assert err < bound
    torch.testing.assert_close(fm.decode(t, fmt, 100, torch.float16), back.half(), rtol=0, atol=0)


def test_kernel_kinds_are_the_formats_own():
    assert fm.IntFormat(8, None).triton_kind == "int8"
    assert fm.IntFormat(8, 64).triton_kind is None              # int8 Triton GEMM: per channel only
    assert fm.IntFormat(4, 64, symmetric=False).triton_kind == "int4"
    assert fm.NF4Format().triton_kind is None and fm.FP8Format().triton_kind is None
    assert fm.IntFormat().cpu_kernel and fm.NF4Format().cpu_kernel and not fm.FP8Format().cpu_kernel
    assert fm.FP8Format().cpu_layout({}, 8) is None


def test_validate_names_the_field():
    with pytest.raises(ValueError, match="supports 2, 3, 4 and 8 bits, got 5"):
        fm.validate(fm.IntFormat(5))
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        fm.validate(fm.NF4Format(0))
    with pytest.raises(ValueError, match="fp8 dtype"):
        fm.validate(fm.FP8Format(torch.float16))
    with pytest.raises(TypeError, match="unknown weight format 'int4'"):
        fm.encode(torch.randn(4, 8), "int4")


@dataclass(frozen=True)
class _Bf16Format(fm.WeightFormat):
    """A format written outside the package: bf16 values, no scale."""

    name: ClassVar[str] = "test-bf16"

    def validate(self) -> None:
        pass

    def encode(self, w):
        return {"qweight": w.to(torch.bfloat16), "scale": torch.ones(w.shape[0], 1)}

    def empty(self, shape, device=None):
        return {"qweight": torch.empty(shape, dtype=torch.bfloat16, device=device),
                "scale": torch.empty(shape[0], 1, device=device)}

    def decode(self, t, K, dtype=torch.float32):
        return (t["qweight"].float() * t["scale"]).to(dtype)


def test_a_new_format_is_one_class():
    lin = nn.Linear(24, 8)
    q = WeightOnlyLinear.from_float(lin, _Bf16Format(), kernel="auto")
    assert q.kernel == "reference"                              # no kernel reads it: the reference path
    x = torch.randn(3, 24)
    torch.testing.assert_close(q(x), nn.functional.linear(x, lin.weight.bfloat16().float(), lin.bias))
    with pytest.raises(ValueError, match="cpu"):
        q.set_kernel("cpu")
    assert q.weight.shape == (8, 24) and q.state_dict()["qweight"].dtype == torch.bfloat16
