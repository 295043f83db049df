"""`make lab`'s server: JupyterLab starts headless as root on 127.0.0.1 and serves the start notebook."""
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_jupyterlab_serves_start_notebook(tmp_path):
    port, token = free_port(), "workbench-test"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path)})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base}/api/status?token={token}", proc, seconds=90)
        with urllib.request.urlopen(f"{base}/api/contents/notebooks/00_start_here.ipynb?token={token}") as r:
            nb = json.load(r)
        assert nb["type"] == "notebook" and nb["content"]["cells"]
        with urllib.request.urlopen(f"{base}/lab?token={token}") as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
        with urllib.request.urlopen(f"{base}/api/kernelspecs?token={token}") as r:
            assert "python3" in json.load(r)["kernelspecs"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
