"""Gradual pruning (Zhu & Gupta schedule, LR rewinding) and sparsity sweeps."""
import pytest

import workbench as wb


def test_polynomial_schedule():
    s = [wb.prune.polynomial_sparsity(t, 0.9, 4) for t in range(1, 5)]
    assert s[-1] == pytest.approx(0.9) and s == sorted(s)
    assert s[0] - 0 > s[-1] - s[-2]                       # prunes fast first, slowly at the end
    assert wb.prune.polynomial_sparsity(1, 0.5, 1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"step must be in \[1, 4\]"):
        wb.prune.polynomial_sparsity(0, 0.9, 4)
    with pytest.raises(ValueError, match=r"final sparsity must be in \[0, 1\)"):
        wb.prune.polynomial_sparsity(1, 1.2, 4)


@pytest.mark.slow   # trains through a pruning schedule: ~15 s
def test_gradual_beats_one_shot_at_high_sparsity(tmp_path):
    model = wb.models.load("digits-mlp")
    task = wb.tasks.load("digits")
    pruned, history = wb.prune.gradual_prune(model, task, "fc*", 0.9, steps=4, epochs_per_step=1, progress=False)
    assert list(history["step"]) == [1, 2, 3, 4] and history["sparsity"].iloc[-1] == pytest.approx(0.9)
    assert all(abs(v - 0.9) < 1e-3 for v in wb.prune.sparsity_of(pruned).values())
    one_shot = wb.apply(model, {"fc*": wb.prune.Magnitude(0.9)})
    wb.training.fit_classifier(one_shot, task, epochs=4, lr=1e-3, progress=False)
    assert task.evaluate(pruned)["accuracy"] >= task.evaluate(one_shot)["accuracy"] - 0.01
    again = wb.load(wb.save(pruned, tmp_path / "g.safetensors"))  # four stacked mask plans reload
    x = task.example_inputs(4)[0]
    assert (again(x) == pruned(x)).all()


def test_sweep_dataframe():
    model = wb.models.load("digits-mlp")
    task = wb.tasks.load("digits")
    df = wb.prune.sweep(model, task, "fc*", sparsities=(0.0, 0.5, 0.9), finetune_epochs=1, progress=False)
    assert list(df.columns) == ["sparsity", "finetuned", "accuracy", "nonzero_weights", "dense_bytes"]
    assert len(df) == 6
    plain = df[~df["finetuned"]].set_index("sparsity")
    assert plain.loc[0.0, "accuracy"] > plain.loc[0.9, "accuracy"]
    assert plain.loc[0.9, "nonzero_weights"] < 0.11 * plain.loc[0.0, "nonzero_weights"]
    tuned = df[df["finetuned"]].set_index("sparsity")
    assert tuned.loc[0.9, "accuracy"] > plain.loc[0.9, "accuracy"]
    with pytest.raises(ValueError, match="sweep method must be one of"):
        wb.prune.sweep(model, task, "fc*", method="taylor")
