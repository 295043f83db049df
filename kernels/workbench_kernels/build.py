"""Build the C++ CPU kernels ahead of time: ``python -m workbench_kernels.build`` (``make install`` runs it).

Each kernel (`w8a8_cpu`, `weight_only_cpu`, `act_int8_cpu`) is compiled into its build folder
(`workbench_kernels._common.extension_build_dir`), or found there when this machine already built it, and one line
per kernel says which and how long it took. Afterwards every process - a notebook kernel, a report, a test - loads
the compiled libraries in a fraction of a second, and says so only on the kernel modules' loggers.

A kernel that cannot be built here (no C++ compiler, no ninja, no Python headers) is named with the compiler's
reason, and the command still exits 0: the quantized modules then run the kernels' PyTorch references. ``--strict``
exits 1 instead.
"""
from __future__ import annotations

import argparse
import time

from workbench_kernels import _common, act_int8_cpu, w8a8_cpu, weight_only_cpu

__all__ = ["KERNELS", "build_all", "main"]

KERNELS = (w8a8_cpu, weight_only_cpu, act_int8_cpu)


def build_all() -> list[_common.BuildRecord]:
    """Build (or load from the build cache) every CPU kernel in this process: how each went."""
    records = []
    for module in KERNELS:
        start = time.perf_counter()
        ext, err = module._build()
        record = _common.last_build(module._NAME)
        if record is None:   # cannot happen: _build records through build_extension; say what we know anyway
            record = _common.BuildRecord(module._NAME, module._WHAT, "cached" if ext is not None else "failed",
                                         time.perf_counter() - start, error=err)
        records.append(record)
    return records


def describe(record: _common.BuildRecord) -> str:
    """One line: the kernel, then built / already built / not built (and why)."""
    if record.status == "built":
        how = f"built in {record.seconds:.1f} s"
    elif record.status == "cached":
        how = f"already built (build cache), loaded in {record.seconds:.2f} s"
    else:
        how = f"NOT built ({record.seconds:.1f} s): {record.reason}"
    return f"{record.name:<26} {record.what:<27} {how}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench_kernels.build",
                                     description="Build the C++ CPU kernels now instead of on first use.")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when a kernel cannot be built")
    args = parser.parse_args(argv)
    records = build_all()
    for record in records:
        print(describe(record), flush=True)
    failed = [r.name for r in records if r.status == "failed"]
    if failed:
        print(f"{len(failed)} of {len(records)} C++ CPU kernels could not be built on this machine (a C++ compiler and "
              "ninja are needed); their PyTorch references run instead (kernel='reference')", flush=True)
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    raise SystemExit(main())
