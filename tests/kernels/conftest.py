"""Shared by the kernel tests: compiling a kernel for an H100 (sm_90) without a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _compile_sm90(script: str, cases: list) -> list:
    """Run ``script`` (which compiles each case with ``triton.compile`` for sm_90 and prints one JSON list) in a
    subprocess without TRITON_INTERPRET, using the ptxas that ships with Triton; skip the test without one."""
    try:
        import triton

        assert triton.knobs.nvidia.ptxas.path  # raises RuntimeError when there is none
    except (ImportError, AttributeError, RuntimeError, AssertionError) as e:
        pytest.skip(f"no ptxas to compile for sm_90 with: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture
def compile_sm90():
    return _compile_sm90
