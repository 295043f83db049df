"""Which x86 instruction sets the CPU code may use, and how one machine runs as another CPU class would.

The machines this project runs on differ (AVX-512 + AMX Xeons, AVX-512 Zen 4 / Zen 5 without AMX, AVX2-only
EPYCs), and every library on the CPU path picks its code by what the CPU reports: PyTorch's ATen kernels, oneDNN
(convolutions, bf16 / int8 GEMMs, the brgemm micro-kernels), MKL (fp32 GEMMs) and this package's C++ kernels
(`weight_only_cpu`, `w8a8_cpu`). Each can be capped below the CPU by an environment variable read once, when the
library initialises - so a cap applies to a new process, not to the one that sets it:

==================  ================================================  =========================================
variable            read by                                           values
==================  ================================================  =========================================
ATEN_CPU_CAPABILITY PyTorch's vectorised ATen kernels                 default, avx2, avx512
ONEDNN_MAX_CPU_ISA  oneDNN (and whether AMX tiles are used at all)    SSE41, AVX2, AVX512_CORE_BF16, ...
MKL_ENABLE_...      MKL (the fp32 GEMM behind F.linear)               SSE4_2, AVX2, AVX512, ...
WORKBENCH_CPU_ISA   this package's C++ kernels                        auto, avx512, avx2, scalar
==================  ================================================  =========================================

`EMULATED` names the CPU classes seen so far and the caps that make this machine run their code; the suite's
other-ISA tier (``make test-isa``) and `workbench.goldens`' spread measurement start processes with them. A cap
only removes instructions: on an AVX2-only CPU, ``EMULATED["avx2"]`` changes nothing.
"""
from __future__ import annotations

import os
from types import MappingProxyType
from typing import Mapping

__all__ = ["ENV", "CAPS", "EMULATED", "isa_cap", "environment", "env_args", "inductor_cache_per_capability"]

ENV = "WORKBENCH_CPU_ISA"
CAPS = ("auto", "avx512", "avx2", "scalar")

# name -> the caps that make this machine run as that CPU class (nothing: as itself)
EMULATED: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "native": MappingProxyType({}),
    # AMD Zen 4 / Zen 5: AVX-512 with VNNI and BF16, no AMX tiles
    "avx512": MappingProxyType({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
    # an AVX2-only EPYC (Zen 2 / Zen 3): no AVX-512, no int8 dot product
    "avx2": MappingProxyType({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                              "MKL_ENABLE_INSTRUCTIONS": "AVX2", ENV: "avx2"}),
    # no vector extension past SSE4: no x86-64 machine of ours, the widest spread of summation orders
    "default": MappingProxyType({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", ENV: "scalar"}),
})


def isa_cap() -> str:
    """``WORKBENCH_CPU_ISA`` as the C++ kernels read it ("auto" when unset); a value they do not know is an error
    naming the variable (the kernels refuse it too)."""
    value = os.environ.get(ENV, "").strip() or "auto"
    if value not in CAPS:
        raise ValueError(f"{ENV} must be one of {', '.join(CAPS)}, got {value!r}")
    return value


def environment(name: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A process environment (``base``, default this one's) with the caps of CPU class ``name`` (a key of
    `EMULATED`) set and every other cap removed, so that a child process runs as that class."""
    if name not in EMULATED:
        raise ValueError(f"unknown CPU class {name!r}; one of {', '.join(EMULATED)}")
    env = dict(os.environ if base is None else base)
    for key in {k for caps in EMULATED.values() for k in caps}:
        env.pop(key, None)
    env.update(EMULATED[name])
    return env


def env_args(name: str) -> list[str]:
    """Arguments for ``env`` that run a command as CPU class ``name``: every other cap unset, this class's set."""
    if name not in EMULATED:
        raise ValueError(f"unknown CPU class {name!r}; one of {', '.join(EMULATED)}")
    unset = sorted({k for caps in EMULATED.values() for k in caps} - set(EMULATED[name]))
    return [a for k in unset for a in ("-u", k)] + [f"{k}={v}" for k, v in EMULATED[name].items()]


def inductor_cache_per_capability() -> str | None:
    """Under ``ATEN_CPU_CAPABILITY`` (and no ``TORCHINDUCTOR_CACHE_DIR`` of the user's other than the default),
    point inductor's on-disk cache at a folder of that capability's own, beside the default one; returns the folder
    set, or None.

    Inductor's cache does not keep the capability apart (torch 2.13): a process capped to AVX2 loaded the compiled
    graphs an uncapped one had written, and the reverse; the compiled Llama decode step then gave wrong tokens
    (AVX2) or corrupted the heap (``malloc(): unaligned tcache chunk detected``, uncapped). Called before
    ``torch.compile`` runs (`workbench.measurement.decode`); inductor reads the variable when it first needs it."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not cap:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # (torch writes the default into the variable when it first asks for the folder: that is not the user's)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return None
    folder = os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-aten-{cap}"
    return folder


if __name__ == "__main__":   # `env $(python -m workbench_kernels.isa avx2) CMD`: CMD as an AVX2-only CPU runs it
    import sys

    if len(sys.argv) != 2 or sys.argv[1] not in EMULATED:
        sys.exit(f"usage: env $(python -m workbench_kernels.isa CLASS) COMMAND; CLASS one of {', '.join(EMULATED)}")
    print(" ".join(env_args(sys.argv[1])))
