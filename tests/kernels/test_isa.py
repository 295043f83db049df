"""The ISA caps (kernels/workbench_kernels/isa.py): one machine runs the code of the other CPU classes. Each cap is read
when a library initialises, so every check runs in a fresh process with the caps set."""
import json
import os
import subprocess
import sys

import pytest

from workbench_kernels import isa

PROBE = r"""
import json, torch
import workbench_kernels.weight_only_cpu as wo
import workbench_kernels.w8a8_cpu as w8
from workbench.quantization import formats as fm
g = torch.Generator().manual_seed(0)
# a product that saturates oneDNN's u8 x s8 pair sums where there is no int8 dot product
x = torch.randn(40, 256, generator=g) * 3
wt = torch.randint(-128, 128, (96, 256), dtype=torch.int8, generator=g).t()
s = torch.rand(1, 96, generator=g) * 1e-2 + 1e-4
y = w8.w8a8_linear_cpu(x, wt, s)
print(json.dumps({"wo_isa": wo.cpu_isa(), "w8_isa": w8.cpu_isa(), "brgemm": wo.brgemm_available(),
                  "amx": wo.split_available(), "bf16": bool(wo.load_extension().native_bf16()),
                  "dot": w8.int8_dot_product(), "int_mm_exact": bool(w8.load_extension().int_mm_exact()),
                  "w8a8_exact": bool(torch.equal(y, w8.reference(x, wt, s))),
                  "aten": torch.backends.cpu.get_cpu_capability()}))
"""


def _probe(cpu_class, **extra):
    env = {**isa.environment(cpu_class), **extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    return out, (json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None)


def test_environment_sets_one_class_and_clears_the_others():
    env = isa.environment("avx512", base={"ATEN_CPU_CAPABILITY": "avx2", isa.ENV: "scalar", "KEEP": "1"})
    assert env == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "KEEP": "1"}
    assert isa.environment("native", base={"ONEDNN_MAX_CPU_ISA": "AVX2"}) == {}
    args = isa.env_args("native")
    assert args[::2] == ["-u"] * 4 and "ONEDNN_MAX_CPU_ISA" in args
    assert isa.env_args("avx2")[-1] == f"{isa.ENV}=avx2"
    with pytest.raises(ValueError, match="unknown CPU class 'zen9'"):
        isa.environment("zen9")


def test_a_bad_cap_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(isa.ENV, "avx1024")
    with pytest.raises(ValueError, match="WORKBENCH_CPU_ISA must be one of"):
        isa.isa_cap()
    out = subprocess.run([sys.executable, "-c", "import workbench_kernels.w8a8_cpu as w; w.cpu_isa()"],
                         env={**os.environ, isa.ENV: "avx1024"}, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "WORKBENCH_CPU_ISA must be auto, avx512, avx2 or scalar" in out.stderr


def test_avx2_class_runs_avx2_code_and_w8a8_stays_exact():
    """As an AVX2-only CPU: the kernels' AVX2 code, no AVX-512 brgemm, no AMX, no bf16 arithmetic, no int8 dot
    product - and oneDNN's int8 GEMM, whose sums saturate there, is replaced by an exact one."""
    out, found = _probe("avx2")
    assert found, out.stderr[-2000:]
    assert found == {"wo_isa": "avx2", "w8_isa": "avx2", "brgemm": False, "amx": False, "bf16": False, "dot": False,
                     "int_mm_exact": False, "w8a8_exact": True, "aten": "AVX2"}


def test_avx512_class_has_no_amx():
    out, found = _probe("avx512")
    assert found, out.stderr[-2000:]
    assert not found["amx"] and found["w8a8_exact"]
    native = _probe("native")[1]
    for key in ("wo_isa", "w8_isa", "brgemm", "bf16", "dot", "int_mm_exact", "aten"):
        assert found[key] == native[key], key   # only AMX differs from this CPU


def test_a_capped_aten_capability_gets_an_inductor_cache_of_its_own(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert isa.inductor_cache_per_capability() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    folder = isa.inductor_cache_per_capability()
    assert folder == os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{default_cache_dir()}-aten-avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())   # torch's own default: replaced too
    assert isa.inductor_cache_per_capability() == folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")   # the user's own choice is kept
    assert isa.inductor_cache_per_capability() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"
