"""The C++ CPU kernels build without a word on stderr: no build notice in a notebook or a report, once they are built
(``make install`` builds them: ``python -m workbench_kernels.build``). Compiling or loading is reported on each kernel
module's logger at INFO, with how long it took; the build command names every kernel, says why one could not be
built and still exits 0 (the kernels have PyTorch references), 1 with ``--strict``."""
import logging
import os
import re
import subprocess
import sys

import pytest

from workbench_kernels import act_int8_cpu, w8a8_cpu, weight_only_cpu

KERNELS = (w8a8_cpu, weight_only_cpu, act_int8_cpu)

# one tiny product through each CPU kernel, in a fresh process (a new notebook kernel)
PROBE = r"""
import torch
from workbench_kernels import act_int8_cpu as ak, w8a8_cpu as w8, weight_only_cpu as wo
from workbench.quantization import formats as fm
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 64, generator=g)
wt = torch.randint(-128, 128, (8, 64), dtype=torch.int8, generator=g).t()
y1 = w8.w8a8_linear_cpu(x, wt, torch.rand(1, 8, generator=g) + 0.01)
fmt = fm.IntFormat(4, 32)
t = fm.encode(torch.randn(8, 64, generator=g), fmt)
y2 = wo.weight_only_linear_cpu(x, wo.pack(t, fmt, 64))
y3 = ak.linear(x, t["qweight"], t["scale"], t.get("zero"), fmt.slot_bits, fmt.group_size, 64)
print("shapes", tuple(y1.shape), tuple(y2.shape), tuple(y3.shape))
"""


def _run(args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_a_fresh_process_running_each_kernel_writes_nothing_on_stderr():
    first = _run(["-c", PROBE])            # builds the kernels if this machine has not yet: no notice either way
    assert first.returncode == 0, first.stderr[-3000:]
    assert "workbench" not in first.stderr, first.stderr[-3000:]
    again = _run(["-c", PROBE])            # a new notebook kernel: the libraries come from the build cache
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == "shapes (2, 8) (2, 8) (2, 8)"
    for word in ("compil", "kernel", "workbench", "cached", "loading"):
        assert word not in again.stderr.lower(), again.stderr[-3000:]


@pytest.mark.parametrize("module", KERNELS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_build_says_what_it_did_on_the_module_logger_only(module, caplog, capfd):
    module._build()                        # built (or loaded) once in this process, so the rerun is a cache load
    capfd.readouterr()
    module._build.cache_clear()            # safe: the rerun loads the same library (no C++ op registration in it)
    with caplog.at_level(logging.INFO, logger=module.__name__):
        ext, err = module._build()
    assert err is None and ext is not None
    messages = [r.getMessage() for r in caplog.records if r.name == module.__name__ and r.levelno == logging.INFO]
    assert any("loading the" in m or "compiling the" in m for m in messages), messages
    assert any(re.search(r"(built|loaded from the build cache) in \d+\.\d+ s$", m) for m in messages), messages
    assert module._NAME in messages[-1] and module._WHAT in messages[-1]
    out, errs = capfd.readouterr()
    assert out == "" and errs == ""
    assert module.load_extension().cpu_isa() in ("avx512", "avx2", "scalar")   # the reloaded extension works


def test_build_command_names_the_three_kernels_and_exits_0():
    r = _run(["-m", "workbench_kernels.build"])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout
    for line, module in zip(lines, KERNELS, strict=True):
        assert line.startswith(module._NAME) and module._WHAT in line
        assert re.search(r"(built in|already built \(build cache\), loaded in) \d+\.\d+ s$", line), line
    assert "compil" not in r.stderr.lower()


def test_build_command_without_a_compiler_says_why_and_exits_0_unless_strict(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"}   # an empty build cache, a broken compiler
    r = _run(["-m", "workbench_kernels.build"], **env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4 and all("NOT built" in line for line in lines[:3]), r.stdout
    assert "PyTorch references run instead" in lines[3]
    assert _run(["-m", "workbench_kernels.build", "--strict"], **env).returncode == 1
