"""wb.models.load on local Hugging Face folders (safetensors only), entry points, and the CLI on user models."""
import sys
import textwrap

import pytest
import torch

import workbench as wb
from workbench.cli import main


def _tiny(kind):
    from transformers import BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    bert = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, num_labels=4, max_position_embeddings=32)
    if kind == "cls":
        return BertForSequenceClassification(bert).eval()
    if kind == "encoder":
        return BertModel(bert).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize("kind", ["cls", "encoder", "lm"])
def test_checkpoint_round_trip_gives_identical_outputs(kind, tmp_path):
    model = _tiny(kind)
    model.save_pretrained(tmp_path)
    again = wb.models.load(str(tmp_path))
    assert type(again) is type(model) and not again.training
    ids = torch.randint(1, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids), again(input_ids=ids)
    key = "last_hidden_state" if kind == "encoder" else "logits"
    assert torch.equal(a[key], b[key])
    assert wb.models.load(tmp_path) is not None  # a pathlib.Path works too


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        wb.models.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        wb.models.load(str(tmp_path / "empty"))
    model = _tiny("cls")
    model.config.save_pretrained(tmp_path / "pickled")                  # a pickle checkpoint, as older tools wrote
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle checkpoint \(pytorch_model.bin\), which is not loaded"):
        wb.models.load(str(tmp_path / "pickled"))
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        wb.models.load("nope")
    assert wb.models.source_of(wb.models.load("digits-mlp")) == "digits-mlp"  # zoo names unchanged


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A user module with model and task factories, importable as ``userpkg_wb``."""
    (tmp_path / "userpkg_wb.py").write_text(textwrap.dedent("""
        import workbench as wb
        from workbench.tasks import data

        def model():
            return wb.models.load("digits-mlp")

        def task():
            s = data.digits()
            return wb.tasks.Classification(s.x_test, s.y_test, calibration=s.x_train, name="my-digits")

        def not_a_task():
            return 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg_wb"
    sys.modules.pop("userpkg_wb", None)


def test_entry_points(user_package):
    assert type(wb.models.load(f"{user_package}:model")).__name__ == "DigitsMLP"
    assert wb.tasks.load(f"{user_package}:task").name == "my-digits"
    with pytest.raises(TypeError, match="returned int, not a wb.tasks.Task"):
        wb.tasks.load(f"{user_package}:not_a_task")
    with pytest.raises(ValueError, match="has no attribute 'nothing'"):
        wb.tasks.load(f"{user_package}:nothing")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_wb'"):
        wb.models.load("no_such_module_wb:model")


def test_cli_shipped_plan_calibrates_from_the_task(capsys):
    from workbench.paths import data_dir

    plan = data_dir() / "plans" / "digits-cnn-mixed.json"
    assert main(["measure", "--model", "digits-cnn", "--plan", str(plan), "--quick", "--threads", "1",
                 "--calibration", "64"]) == 0
    out = capsys.readouterr().out
    assert "digits-cnn-mixed.json" in out and "accuracy" in out


def test_cli_fidelity_on_a_local_checkpoint(tmp_path, capsys):
    from safetensors.torch import save_file

    model = _tiny("cls")
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(1, 100, (16, 12), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path / "inputs.safetensors")
    plan = tmp_path / "plan.json"
    wb.Plan({"bert.encoder.layer.*.intermediate.dense": wb.quant.WeightOnly(bits=8, group_size=None)}).save(plan)
    assert main(["measure", "--model", str(tmp_path / "ckpt"), "--task", "fidelity", "--inputs",
                 str(tmp_path / "inputs.safetensors"), "--plan", str(plan), "--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "kl_divergence" in out and "top1_agreement" in out and "plan.json" in out
    assert main(["measure", "--model", str(tmp_path / "ckpt"), "--task", "fidelity"]) == 2
    assert "--task fidelity needs --inputs" in capsys.readouterr().err
    assert main(["measure", "--model", str(tmp_path / "ckpt")]) == 2
    assert "--task is required" in capsys.readouterr().err


def test_cli_entry_points_and_mismatch(user_package, capsys):
    assert main(["measure", "--model", f"{user_package}:model", "--task", f"{user_package}:task", "--quick",
                 "--threads", "1"]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert main(["measure", "--model", "digits-cnn", "--task", "tiny-lm", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "DigitsCNN does not fit task 'tiny-lm'" in err and "(2, 128) int64" in err


def test_cli_app_takes_entry_points(user_package, tmp_path, monkeypatch):
    import json
    import os

    class Served(Exception):
        pass

    seen = {}

    def execv(exe, cmd):  # stop where the CLI would become the Voila server
        seen.update(cmd=cmd)
        raise Served

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(os, "name", "posix")
    for name in ("WORKBENCH_FILES_ROOT", "WORKBENCH_FILES_URL", "WORKBENCH_REPORTS", "JUPYTER_PATH"):
        monkeypatch.delenv(name, raising=False)   # `app` sets them for the server it becomes: restored afterwards
    with pytest.raises(Served):
        main(["app", "--model", f"{user_package}:model", "--task", f"{user_package}:task", "--out", str(tmp_path)])
    path = tmp_path / f"app_{user_package}_model.ipynb"
    assert str(path) in seen["cmd"]
    source = "".join(c["source"] if isinstance(c["source"], str) else "".join(c["source"])
                     for c in json.loads(path.read_text())["cells"])
    assert f"model_name = \"{user_package}:model\"" in source and f"task_name = \"{user_package}:task\"" in source
    assert main(["app", "--model", f"{user_package}:model"]) == 2  # a user model needs a task
