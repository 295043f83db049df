"""The ``workbench`` command.

    workbench measure --model minilm --task minilm [--plan plan.json] [--calibration 128] [--quick] [--threads 2]
    workbench measure --model path/to/hf-checkpoint --task fidelity --inputs inputs.safetensors --plan plan.json
    workbench report notebooks/00_start_here.ipynb -p model_name digits-mlp -p task_name digits
    workbench app --model digits-cnn --task digits [--port 8866]    # the workbench as a Voila dashboard
    workbench app --model mypkg.models:build --task mypkg.tasks:build  # user model and task (entry points)
    workbench goldens [NOTEBOOK ...] [--update]                      # notebooks as a regression suite
    workbench export --model path/to/hf-checkpoint --plan plan.json --out folder [--format compressed-tensors|gguf]
    workbench models | workbench tasks
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path


def _parse_value(text: str):
    """A -p value: a Python literal (number, bool, None, list...) when it parses as one, else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _task_for(args: argparse.Namespace, model):
    """The task ``--task`` names: a zoo task, ``fidelity`` (agreement with the unmodified model on ``--inputs``),
    or a ``package.module:factory`` entry point; by default the zoo model's own task."""
    import workbench as wb

    if args.task == "fidelity":
        if not args.inputs:
            raise ValueError("--task fidelity needs --inputs FILE (.safetensors, .npz or .npy) with the model inputs")
        from workbench.tasks.inputs import read_inputs

        return wb.tasks.Fidelity(model, read_inputs(args.inputs))
    if args.task:
        return wb.tasks.load(args.task)
    if args.model in wb.models.names():
        return wb.tasks.load(wb.models.spec(args.model).task)
    raise ValueError(f"--task is required for {args.model!r}, which is not a zoo model: a task name "
                     f"({', '.join(wb.tasks.names())}), fidelity, or package.module:factory")


def _measure(args: argparse.Namespace) -> int:
    import pandas as pd

    import workbench as wb
    from workbench.analysis.sweep import apply_with_task

    model = wb.models.load(args.model)
    task = _task_for(args, model)
    wb.tasks.check_fit(model, task)
    runs = [("baseline", model)]
    if args.plan:
        plan = wb.Plan.read(args.plan)
        runs.append((Path(args.plan).name, apply_with_task(model, task, plan, args.calibration)))
    results = [wb.measure(m, task, quick=args.quick, threads=args.threads, batch_size=args.batch_size)
               for _, m in runs]
    with pd.option_context("display.max_columns", None, "display.width", 200):
        print(wb.compare(*results, labels=[label for label, _ in runs]).T.to_string())
    return 0


def _export(args: argparse.Namespace) -> int:
    """Apply a plan to a model and write the result in a deployable format (`wb.export`); the tokenizer files of a
    checkpoint folder go with it."""
    import workbench as wb
    from workbench.analysis.sweep import apply_with_task
    from workbench.export import ONNX

    if args.format == "onnx" and not args.task:
        raise ValueError("--format onnx traces the model with an example batch: give --task")
    model = wb.models.load(args.model)
    plan = wb.Plan.read(args.plan)
    task = _task_for(args, model) if args.task else None
    if task is not None:   # a plan that calibrates (GPTQ, AWQ, static activations) draws its samples from the task
        small = apply_with_task(model, task, plan, args.calibration)
    else:
        small = wb.apply(model, plan)
    base = Path(args.model) if Path(args.model).is_dir() else None
    fmt = ONNX.for_task(task) if args.format == "onnx" else args.format
    out = wb.export(small, args.out, format=fmt, base_folder=base, overwrite=args.overwrite)
    print(f"wrote {out} ({args.format}): {len(wb.applied_report(small))} layer(s) in the applied report")
    return 0


def _report_parameter(value):
    """A -p value that names an existing file relative to where the command runs becomes an absolute path: the
    notebook runs in its own folder, where ``-p plan my_plan.json`` would name nothing."""
    if isinstance(value, str) and value and not os.path.isabs(value) and Path(value).is_file():
        return str(Path(value).resolve())
    return value


def _report_key(params: dict) -> str:
    """What a report is of, for its name's hash (`report_stem`): the parameters, a file (a plan) by its content, so
    one plan's reports share the hash wherever its file lies."""
    import hashlib
    import json

    def key(value):
        if isinstance(value, str) and value and Path(value).is_file():
            return {"file sha256": hashlib.sha256(Path(value).read_bytes()).hexdigest()}
        return value

    return json.dumps({k: key(v) for k, v in sorted(params.items())}, sort_keys=True, default=repr)


def _report(args: argparse.Namespace) -> int:
    from workbench.reports import report_stem, reports_dir, run_notebook

    params = {k: _report_parameter(_parse_value(v)) for k, v in (args.parameter or [])}
    out = reports_dir() if args.out is None else Path(args.out)
    name = args.name or report_stem(Path(args.notebook).stem, _report_key(params), out)
    nb, html = run_notebook(args.notebook, params, out_dir=out, name=name)
    print(f"notebook: {nb}\nhtml:     {html}")
    return 0


def _app(args: argparse.Namespace) -> int:
    """Serve notebooks/app.ipynb, parameterised for the model and task, as a Voila dashboard."""
    import subprocess

    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from workbench import models, tasks

    source = Path(__file__).resolve().parent.parent / "notebooks" / "app.ipynb"
    if not source.exists():
        raise FileNotFoundError(f"{source} is missing: `workbench app` runs from a source checkout (pip install -e .)")
    from workbench.entry_points import is_entry_point

    # unknown names fail here, before a server starts; entry points are imported and built once to check them
    if is_entry_point(args.model):
        if not args.task:
            raise ValueError(f"--task is required with the model entry point {args.model!r}")
        tasks.check_fit(models.load(args.model), tasks.load(args.task))
    else:
        models.spec(args.model)
    task = args.task or models.spec(args.model).task
    if not is_entry_point(args.model):
        tasks.load(task)
    nb = parameterize_notebook(load_notebook_node(str(source)),
                               {"model_name": args.model, "task_name": task, "threads": args.threads})
    from workbench.reports import reports_dir

    out = reports_dir() if args.out is None else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"app_{args.model.replace(':', '_').replace('/', '_')}.ipynb"
    nbformat.write(nb, str(path))
    print(f"serving {path} at http://{args.ip}:{args.port}/ (Ctrl-C stops)", flush=True)
    # Voila serves the notebook's folder (also where the Report button writes) and, allowed here, its .html
    # reports and the widgets' JavaScript modules (workbench.ui.widgets) under /voila/files/; the kernel learns
    # that URL from the environment (wb.reports.browser_url)
    os.environ.update(WORKBENCH_FILES_ROOT=str(out.resolve()), WORKBENCH_FILES_URL="/voila/files/",
                      WORKBENCH_REPORTS=str(out.resolve()))
    # the page's template (workbench/ui/share/voila/templates/workbench: Voila's lab template without CDN requests)
    # is found on the Jupyter data path
    share = str(Path(__file__).resolve().parent / "ui" / "share")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (share, os.environ.get("JUPYTER_PATH")) if p)
    cmd = [sys.executable, "-m", "voila", str(path), "--no-browser", f"--port={args.port}", f"--Voila.ip={args.ip}",
           "--template=workbench", r"--VoilaConfiguration.file_allowlist=.*\.(png|jpg|gif|svg|html|js)"]
    if os.name == "posix":   # become the server: a SIGTERM to this process then stops Voila and its kernels,
        sys.stdout.flush()   # instead of orphaning them behind a dead parent
        os.execv(sys.executable, cmd)
    return subprocess.call(cmd)


def _goldens(args: argparse.Namespace) -> int:
    """Run notebooks with their golden parameters and compare (or, with --update, rewrite) their metrics."""
    import tempfile

    from tqdm.auto import tqdm

    from workbench import goldens
    from workbench_kernels import isa

    selected = [goldens.load(n) for n in args.notebooks] if args.notebooks else goldens.load_all()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="workbench-goldens-"))
    if args.measure and not args.cpu_class:
        raise ValueError("--measure records values under a CPU class: give --cpu-class")
    if args.cpu_class:   # the notebooks' kernels are new processes: they start with this class's caps
        env = isa.environment(args.cpu_class)
        os.environ.clear()
        os.environ.update(env)
        print(f"running as CPU class {args.cpu_class!r}: {dict(isa.EMULATED[args.cpu_class]) or 'no caps'}")
    failures: list[str] = []
    for golden in tqdm(selected, desc="notebooks", unit="nb"):
        recorded, nb, _ = goldens.run(golden, out)
        if args.measure:
            goldens.record_measured(golden, args.cpu_class, recorded)
            print(f"{golden.notebook}: recorded {len(golden.metrics)} metric(s) as {args.cpu_class} in {golden.path}")
        if args.update:
            goldens.update(golden, recorded)
            print(f"{golden.notebook}: updated {len(golden.metrics)} metric(s) in {golden.path}")
            continue
        found = goldens.compare(golden, recorded)
        failures += found
        print(f"{golden.notebook}: {'FAIL' if found else 'ok'} ({len(golden.metrics)} metric(s); executed: {nb})")
        for line in goldens.not_applicable(golden, recorded):
            print(f"  {line}")
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


def _list_models(args: argparse.Namespace) -> int:
    from workbench import models

    for name in models.names():
        s = models.spec(name)
        print(f"{s.name:12s} task={s.task:8s} {s.description}")
    return 0


def _list_tasks(args: argparse.Namespace) -> int:
    from workbench import tasks

    print("\n".join(tasks.names()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench", description="Measured model compression.")
    sub = parser.add_subparsers(dest="command", required=True)

    m = sub.add_parser("measure", help="measure a zoo model (and optionally a plan applied to it)")
    m.add_argument("--model", required=True, help="zoo model name (see `workbench models`), a local Hugging Face "
                   "checkpoint folder (config.json + *.safetensors) or package.module:factory")
    m.add_argument("--task", help="task name, 'fidelity' (agreement with the unmodified model on --inputs; no "
                   "labels) or package.module:factory (default: the zoo model's own task)")
    m.add_argument("--inputs", help="model inputs for --task fidelity (.safetensors, .npz or .npy)")
    m.add_argument("--plan", help="plan JSON file (wb.Plan.save) to apply and compare")
    m.add_argument("--calibration", type=int, default=128,
                   help="calibration samples drawn from the task when the plan needs them (default: 128)")
    m.add_argument("--quick", action="store_true", help="primary metric on the quick subset, fewer timing runs")
    m.add_argument("--threads", type=int, default=None, help="CPU threads for the measurement")
    m.add_argument("--batch-size", type=int, default=None, help="batch size for latency and memory")
    m.set_defaults(func=_measure)

    r = sub.add_parser("report", help="run a notebook with papermill into the reports folder as .ipynb and a "
                       "standalone .html")
    r.add_argument("notebook")
    r.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="notebook parameter (repeatable); values are Python literals or strings")
    r.add_argument("--out", default=None, help="output folder (default: $WORKBENCH_REPORTS, else reports/ at the "
                   "repository root - the folder the workbench's Report button writes to)")
    r.add_argument("--name", default=None, help="output file stem (default: <notebook>-<hash of the parameters, a "
                   "plan file by its content>-<YYYYmmdd-HHMMSS>, so a rerun never overwrites a report)")
    r.set_defaults(func=_report)

    a = sub.add_parser("app", help="serve the interactive workbench as a standalone Voila dashboard")
    a.add_argument("--model", default="digits-cnn", help="zoo model name (see `workbench models`) or "
                   "package.module:factory")
    a.add_argument("--task", help="task name or package.module:factory (default: the zoo model's own task)")
    a.add_argument("--port", type=int, default=8866)
    a.add_argument("--ip", default="127.0.0.1")
    a.add_argument("--threads", type=int, default=2, help="CPU threads for measurements")
    a.add_argument("--out", default=None, help="where the parameterised app notebook and its reports are written "
                   "(default: the reports folder, as for `workbench report`)")
    a.set_defaults(func=_app)

    g = sub.add_parser("goldens", help="run notebooks and compare their metrics with data/golden (regression suite)")
    g.add_argument("notebooks", nargs="*", help="notebook names (default: every golden file)")
    g.add_argument("--update", action="store_true", help="rewrite the golden values from this run (deliberate)")
    g.add_argument("--out", default=None, help="where executed notebooks go (default: a temporary folder)")
    g.add_argument("--cpu-class", default=None, help="run the notebooks as this CPU class would (its ISA caps, "
                   "workbench_kernels.isa.EMULATED: native, avx512, avx2, default)")
    g.add_argument("--measure", action="store_true", help="store the values found under --cpu-class in the golden "
                   "files (\"measured\"), for tolerances that hold on every CPU")
    g.set_defaults(func=_goldens)

    e = sub.add_parser("export", help="apply a plan and write the model in a deployable format (wb.export)")
    e.add_argument("--model", required=True, help="a local Hugging Face checkpoint folder (its tokenizer files are "
                   "copied), a zoo model name or package.module:factory")
    e.add_argument("--plan", required=True, help="plan JSON file (wb.Plan.save)")
    e.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out folder (once the new one is "
                   "complete)")
    e.add_argument("--format", default="compressed-tensors", help="compressed-tensors (vLLM, transformers), gguf "
                   "(llama.cpp, Ollama) or onnx (ONNX Runtime: traced with the --task's example batch)")
    e.add_argument("--task", help="task for plans that calibrate (GPTQ, AWQ, static activations) and for onnx's "
                   "example batch: a task name, fidelity or package.module:factory")
    e.add_argument("--inputs", help="model inputs for --task fidelity (.safetensors, .npz or .npy)")
    e.add_argument("--calibration", type=int, default=128, help="calibration samples (default: 128)")
    e.set_defaults(func=_export)

    sub.add_parser("models", help="list the zoo models").set_defaults(func=_list_models)
    sub.add_parser("tasks", help="list the tasks").set_defaults(func=_list_tasks)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:  # TaskMismatchError: a ValueError
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
