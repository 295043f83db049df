"""`wb.export` itself, whatever the format: a new folder, or with ``overwrite=True`` the old one replaced only once
the new one is complete."""
import pytest
import torch
from torch import nn

import workbench as wb
from workbench.export import ONNX


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return wb.apply(nn.Sequential(nn.Linear(64, 32)), {"0": wb.quant.WeightOnly(bits=4, group_size=32)},
                    progress=False)


def _format() -> ONNX:
    return ONNX(example_inputs=(torch.randn(2, 64),))


def test_overwrite_replaces_a_previous_export(tmp_path):
    target = tmp_path / "out"
    wb.export(_model(0), target, format=_format())
    first = (target / "model.onnx").read_bytes()
    with pytest.raises(FileExistsError, match="exists and is not an empty folder"):
        wb.export(_model(1), target, format=_format())
    assert (target / "model.onnx").read_bytes() == first
    (target / "stale.txt").write_text("from before")
    assert wb.export(_model(1), target, format=_format(), overwrite=True) == target
    assert sorted(p.name for p in target.iterdir()) == ["model.onnx"]
    assert (target / "model.onnx").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # no temporary folder left beside it


def test_a_failed_overwrite_keeps_the_old_folder(tmp_path, monkeypatch):
    target = tmp_path / "out"
    wb.export(_model(0), target, format=_format())
    first = (target / "model.onnx").read_bytes()

    def fail(self, prepared, folder):
        (folder / "model.onnx").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ONNX, "write", fail)
    with pytest.raises(OSError, match="disk full"):
        wb.export(_model(1), target, format=_format(), overwrite=True)
    assert (target / "model.onnx").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_never_replaces_a_file(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(FileExistsError, match="is not a folder"):
        wb.export(_model(0), tmp_path / "out", format=_format(), overwrite=True)
    assert (tmp_path / "out").read_text() == "a file"


def test_onnx_for_task_leaves_the_batch_free(tmp_path):
    import numpy as np
    import onnxruntime as ort

    task = wb.tasks.load("digits")
    model = wb.apply(wb.models.load("digits-mlp"), {"fc*": wb.quant.WeightOnly(bits=4, group_size=32)},
                     progress=False)
    folder = wb.export(model, tmp_path / "mlp", format=ONNX.for_task(task))
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input0"]
    x = task.example_inputs(5)[0]
    with torch.no_grad():
        ours = model(x).numpy()
    theirs = session.run(None, {"input0": x.numpy()})[0]
    assert theirs.shape == (5, 10) and np.abs(theirs - ours).max() <= 1e-4 * max(1.0, np.abs(ours).max())


def test_export_command_onnx_needs_a_task_and_overwrites_on_request(tmp_path, capsys):
    """`workbench export --format onnx --task digits` traces with the task's example batch; --overwrite replaces."""
    import onnx

    from workbench.cli import main

    wb.Plan({"fc*": wb.quant.WeightOnly(bits=4, group_size=32)}).save(tmp_path / "plan.json")
    out = tmp_path / "out"
    args = ["export", "--model", "digits-mlp", "--plan", str(tmp_path / "plan.json"), "--out", str(out), "--format",
            "onnx"]
    assert main(args) == 2 and "give --task" in capsys.readouterr().err
    assert not out.exists()
    assert main(args + ["--task", "digits"]) == 0 and "wrote" in capsys.readouterr().out
    graph = onnx.load(str(out / "model.onnx")).graph
    assert [n.op_type for n in graph.node].count("MatMulNBits") == 3
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert main(args + ["--task", "digits"]) == 2 and "is not an empty folder" in capsys.readouterr().err
    assert main(args + ["--task", "digits", "--overwrite"]) == 0


def test_runtime_model_picks_the_runtime_of_each_format(tmp_path):
    """`runtime_model(folder, format)`: ONNX Runtime, llama.cpp, transformers' loader - each giving the exported
    model's outputs (within the fp32 rounding / activation rounding the format tests state)."""
    transformers = pytest.importorskip("transformers")
    from workbench.export.runtimes import LlamaCppModel, OnnxRuntimeModel, runtime_model

    mlp = wb.apply(wb.models.load("digits-mlp"), {"fc*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    task = wb.tasks.load("digits")
    onnx_model = runtime_model(wb.export(mlp, tmp_path / "onnx", format=ONNX.for_task(task)), "onnx")
    x = task.example_inputs(3)[0]
    with torch.no_grad():
        assert isinstance(onnx_model, OnnxRuntimeModel)
        assert (onnx_model(x) - mlp(x)).abs().max().item() <= 1e-4 * max(1.0, mlp(x).abs().max().item())

    llama = wb.models.load("tiny-llama")
    gguf_model = runtime_model(wb.export(llama, tmp_path / "gguf", format="gguf"), "gguf", config=llama.config)
    assert isinstance(gguf_model, LlamaCppModel) and gguf_model.config is llama.config
    gguf_model.close()

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    small = wb.apply(transformers.LlamaForCausalLM(cfg).eval(),
                     {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    hf = runtime_model(wb.export(small, tmp_path / "ct"), "compressed-tensors")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert type(hf).__name__ == "LlamaForCausalLM"
        assert (hf(ids).logits - small(ids).logits).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="unknown export format 'tflite'"):
        runtime_model(tmp_path / "onnx", "tflite")


def test_onnx_file_records_its_producer_and_the_reader_versions(tmp_path):
    import importlib.metadata
    import json

    import onnx

    model = _model(0)
    proto = onnx.load(str(wb.export(model, tmp_path / "out", format=_format()) / "model.onnx"))
    props = {p.key: p.value for p in proto.metadata_props}
    assert (proto.producer_name, proto.producer_version) == ("workbench", wb.__version__)
    assert props["workbench.onnxruntime_version"] == importlib.metadata.version("onnxruntime") == "1.31.1"
    assert props["workbench.onnx_version"] == onnx.__version__ == "1.23.2"
    assert props["workbench.torch_version"] == torch.__version__
    assert json.loads(props["workbench.plans"]) == [p.to_dict() for p in wb.applied_plans(model)]
