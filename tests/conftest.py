"""Shared fixtures, and the test tiers. MiniLM is loaded once per session (it takes a few seconds).

Tiers (markers registered in pyproject.toml): `make test` runs everything; `make test-fast` deselects
``slow`` (ML claims that train or load real models for minutes), ``notebook`` (papermill runs) and ``e2e``
(servers and a real browser). Everything under tests/e2e/ is marked ``e2e`` here; ``gpu`` tests are skipped,
saying so, without a CUDA GPU (or under the Triton interpreter, which is not the GPU path they check)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run under the interpreter on machines without a GPU. Triton reads the variable when a kernel
# is decorated, so it is set here, before any test module imports `kernels`.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = {"e2e": "e2e"}   # first folder under tests/ -> marker every test in it gets


def pytest_report_header(config):
    """Which CPU code runs: the ISA caps in force (kernels/workbench_kernels/isa.py; `make test-isa` sets them)."""
    from workbench_kernels.isa import EMULATED

    caps = {k: os.environ[k] for k in sorted({k for c in EMULATED.values() for k in c}) if k in os.environ}
    return f"CPU ISA caps: {caps or 'none (this CPU as it is)'}"


def pytest_collection_modifyitems(config, items):
    import torch

    no_gpu = None
    if not torch.cuda.is_available():
        no_gpu = "needs a CUDA GPU"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        no_gpu = "needs compiled GPU kernels (TRITON_INTERPRET=1 is set)"
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(TESTS):
            marker = FOLDER_MARKERS.get(path.relative_to(TESTS).parts[0])
            if marker:
                item.add_marker(marker)
        if no_gpu and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=no_gpu))


# The C++ CPU kernels compile on first use into TORCH_EXTENSIONS_DIR (torch.utils.cpp_extension). One folder per
# checkout: checkouts of different sources on one machine (worktrees, a fresh clone beside a working copy) share
# ~/.cache/torch_extensions otherwise and rebuild each other's library at every switch. Set here, it reaches the
# notebooks' kernels and the CLI subprocesses of the tests too.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Analysis results are cached on disk; tests never read or write the user's cache."""
    os.environ["WORKBENCH_CACHE"] = str(tmp_path_factory.mktemp("workbench-cache"))


@pytest.fixture(scope="session")
def minilm():
    import workbench as wb

    return wb.models.load("minilm")


@pytest.fixture(scope="session")
def minilm_task():
    import workbench as wb

    return wb.tasks.load("minilm")


@pytest.fixture
def digits_mlp():
    import workbench as wb

    return wb.models.load("digits-mlp")


@pytest.fixture(scope="session")
def digits_task():
    import workbench as wb

    return wb.tasks.load("digits")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc, seconds: float = 120) -> None:
    """Poll ``url`` until it answers 200, failing if ``proc`` exits or time runs out."""
    import time
    import urllib.request

    deadline = time.time() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise AssertionError(f"{url} did not answer within {seconds:.0f} s (server exit code {proc.poll()})")
        time.sleep(0.5)


@pytest.fixture
def serve(tmp_path):
    """Start a server command (list of args) in the repository root; yields a starter, stops all at the end."""
    import subprocess
    import sys
    from pathlib import Path

    procs = []
    root = Path(__file__).resolve().parent.parent

    def start(args, url, seconds=120):
        log = open(tmp_path / f"server{len(procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")})
        procs.append(proc)
        wait_for_http(url, proc, seconds)
        return proc

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()


# --- kernels: compiling a kernel for an H100 (sm_90) without a GPU ------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


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
