"""Shared fixtures. MiniLM is loaded once per session (it takes a few seconds)."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run under the interpreter on machines without a GPU. Triton reads the variable when a kernel
# is decorated, so it is set here, before any test module imports `kernels`.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


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
