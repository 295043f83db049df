"""The zoo and the tasks: accuracy floors, disjoint calibration data, clear errors for bad names."""
import numpy as np
import pytest
import torch

import workbench as wb
from workbench.tasks import data


def test_names_and_unknown_names():
    assert wb.models.names() == ["digits-mlp", "digits-cnn", "mnist1d-cnn", "tiny-lm", "tiny-llama", "minilm",
                                 "efficientnet-lite0"]
    assert wb.tasks.names() == ["digits", "mnist1d", "tiny-lm", "tiny-llama", "minilm", "imagenet-photos"]
    with pytest.raises(ValueError, match="unknown model 'resnet'; available models: digits-mlp, digits-cnn"):
        wb.models.load("resnet")
    with pytest.raises(ValueError,
                       match="unknown task 'imagenet'; available tasks: digits, mnist1d, tiny-lm, tiny-llama"):
        wb.tasks.load("imagenet")


@pytest.mark.parametrize("name, metric, floor", [
    ("digits-mlp", "accuracy", 0.97),
    ("digits-cnn", "accuracy", 0.97),
    ("mnist1d-cnn", "accuracy", 0.95),
])
def test_classifiers_meet_their_accuracy_floor(name, metric, floor):
    model = wb.models.load(name)
    assert not model.training
    task = wb.tasks.load(wb.models.spec(name).task)
    assert task.evaluate(model)[metric] >= floor
    quick = task.evaluate(model, quick=True)[metric]
    assert quick >= floor - 0.02


def test_tiny_lm_perplexity():
    model = wb.models.load("tiny-lm")
    task = wb.tasks.load("tiny-lm")
    ppl = task.evaluate(model)["perplexity"]
    # character-level: uniform guessing over the vocabulary would score len(vocab) (81)
    assert 2.0 < ppl < 6.0, ppl
    assert not task.primary.higher_is_better
    untrained = wb.models.architectures.TinyLM(model.config).eval()
    assert task.evaluate(untrained, quick=True)["perplexity"] > 40


def test_classification_calibration_is_disjoint_from_test():
    split = data.digits()
    task = wb.tasks.load("digits")
    calib = torch.cat([b[0] for b in task.calibration(500, batch_size=100)]).numpy()
    assert calib.shape == (500, 64)
    test_rows = {r.tobytes() for r in split.x_test}
    train_rows = {r.tobytes() for r in split.x_train}
    assert not any(r.tobytes() in test_rows and r.tobytes() not in train_rows for r in calib)
    assert all(r.tobytes() in train_rows for r in calib)
    assert len(task.calibration_labels(500)) == 500
    # deterministic
    again = torch.cat([b[0] for b in task.calibration(500, batch_size=100)]).numpy()
    np.testing.assert_array_equal(calib, again)


def test_tiny_lm_calibration_comes_from_training_text():
    task = wb.tasks.load("tiny-lm")
    batches = task.calibration(20, batch_size=8)
    assert [b[0].shape for b in batches] == [(8, 128), (8, 128), (4, 128)]
    train = task.corpus.train
    for row in torch.cat([b[0] for b in batches]).numpy():
        text = task.corpus.decode(row)
        assert text in task.corpus.decode(train)
    assert task.example_inputs(2)[0].shape == (2, 128)


def test_bad_calibration_counts():
    task = wb.tasks.load("digits")
    with pytest.raises(ValueError, match="asked for 5000 samples, but the split has only 1257"):
        task.calibration(5000)
    with pytest.raises(ValueError, match="must be a positive int"):
        task.calibration(0)


def test_example_inputs_shapes():
    assert wb.tasks.load("digits").example_inputs(3)[0].shape == (3, 64)
    assert wb.tasks.load("mnist1d").example_inputs(2000)[0].shape == (2000, 40)


def test_shipped_weights_are_reproducible(tmp_path):
    """`python -m workbench.models.train digits-mlp` reproduces a model of the shipped quality."""
    from workbench.models.train import train

    meta = train("digits-mlp", tmp_path)
    import json
    assert json.loads(meta["test_metric"])["accuracy"] >= 0.97
    assert (tmp_path / "digits-mlp.safetensors").is_file()


def test_evaluate_uses_eval_mode_and_restores_the_mode(digits_task):
    """BatchNorm must use its running statistics (and not update them) while a task evaluates a training model."""
    import workbench as wb

    model = wb.models.load("digits-cnn")
    expected = digits_task.evaluate(model.eval(), quick=True)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert digits_task.evaluate(model, quick=True) == expected
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
