"""`make lab`'s server, started with the arguments the Makefile gives it: JupyterLab headless as root on 127.0.0.1,
the repository as its folder (so reports/ is inside it and the Report button's links open), its URL opening the
start notebook."""
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[2]


def make_lab_arguments() -> list[str]:
    """The arguments `make lab` gives ``jupyter lab``, as make prints them (``make -n``, the set-up skipped), so the
    tests start the server exactly as a person does."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "lab"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.replace("\\\n", " ")
    words = shlex.split(next(line for line in out.splitlines() if re.search(r"jupyter lab\b", line)))
    return words[words.index("lab") + 1:]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


@pytest.mark.slow
def test_jupyterlab_serves_start_notebook(tmp_path):
    port, token = free_port(), "workbench-test"
    args = make_lab_arguments()
    assert {"--ip=127.0.0.1", "--no-browser", "--allow-root", f"--ServerApp.root_dir={ROOT}"} <= set(args), args
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", *args, f"--port={port}", f"--IdentityProvider.token={token}"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path)})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base}/api/status?token={token}", proc, seconds=90)
        (server,) = [json.loads(p.read_text()) for p in tmp_path.glob("jpserver-*.json")]
        assert Path(server["root_dir"]).resolve() == ROOT                  # reports/ lies inside what it serves
        try:                                                               # the printed URL (and /) opens the notebook
            urllib.request.build_opener(_NoRedirect).open(f"{base}/?token={token}")
            raise AssertionError("/ does not redirect")
        except urllib.error.HTTPError as e:
            location = urllib.parse.urlparse(e.headers["Location"]).path
            assert e.code == 302 and location == "/lab/tree/notebooks/00_start_here.ipynb", (e.code, location)
        with urllib.request.urlopen(f"{base}/api/contents/notebooks/00_start_here.ipynb?token={token}") as r:
            nb = json.load(r)
        assert nb["type"] == "notebook" and nb["content"]["cells"]
        with urllib.request.urlopen(f"{base}/api/contents?token={token}") as r:
            assert {"notebooks", "workbench"} <= {f["name"] for f in json.load(r)["content"]}
        with urllib.request.urlopen(f"{base}/lab/tree/notebooks/00_start_here.ipynb?token={token}") as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
        with urllib.request.urlopen(f"{base}/api/kernelspecs?token={token}") as r:
            assert "python3" in json.load(r)["kernelspecs"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
