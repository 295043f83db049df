"""Mixed-precision training: GradScaler semantics, skipped-step counting, the measured comparison."""
import copy

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.precision import AmpStep


def _setup(precision, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, AmpStep(model, opt, precision, **kw), torch.randn(8, 4)


def test_fp16_overflow_step_is_skipped_and_the_scale_halves():
    model, step, x = _setup("fp16")
    assert step.scale == 2.0 ** 16
    before = model.weight.detach().clone()
    step(lambda: model(x).sum() * torch.tensor(float("inf")))          # forced overflow
    assert step.skipped == 1 and step.scale == 2.0 ** 15
    assert torch.equal(model.weight, before)                            # the step was skipped
    step(lambda: model(x).float().pow(2).mean())
    assert step.skipped == 1 and step.scale == 2.0 ** 15 and not torch.equal(model.weight, before)
    assert model.weight.dtype == torch.float32                          # fp32 master weights


def test_scale_grows_after_growth_interval_good_steps():
    model, step, x = _setup("fp16", growth_interval=3)
    for _ in range(3):
        step(lambda: model(x).float().pow(2).mean())   # the loss in fp32, as cross_entropy is under autocast
    assert step.scale == 2.0 ** 17 and step.skipped == 0 and step.steps == 3


def test_bf16_needs_no_scaling_and_counts_bad_steps():
    model, step, x = _setup("bf16")
    seen = {}

    def loss():
        out = model(x)
        seen["dtype"] = out.dtype
        return out.float().pow(2).mean()

    step(loss)
    assert seen["dtype"] == torch.bfloat16 and step.scale == 1.0
    step(lambda: model(x).sum() * float("nan"))
    assert step.skipped == 1


def test_bad_precision_and_weights():
    with pytest.raises(ValueError, match="precision must be one of"):
        _setup("fp8")
    half = nn.Linear(4, 2).half()
    with pytest.raises(ValueError, match="trainable parameters must be fp32"):
        AmpStep(half, torch.optim.SGD(half.parameters(), lr=0.1), "fp16")


def test_compare_precisions_table():
    from workbench.models.architectures import DigitsMLP

    df = wb.precision.compare_precisions(DigitsMLP(), wb.tasks.load("digits"), epochs=2,
                                         threads=1, progress=False)
    assert list(df["precision"]) == ["fp32", "bf16", "fp16"]
    assert (df["step_ms"] > 0).all() and (df["peak_step_memory_bytes"] > 0).all()
    assert (df["accuracy"] > 0.8).all() and (df["threads"] == 1).all()
    assert (df["accuracy"] - df.loc[0, "accuracy"]).abs().max() < 0.03   # same seed, same budget: alike
    assert df.loc[df["precision"] == "fp16", "final_scale"].item() >= 2.0 ** 15


def test_blockwise_codebook_keeps_relative_precision():
    from workbench.precision.optim import dequantize_blockwise, quantize_blockwise

    x = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-5, 0, 3000)
    for signed, values in ((True, x), (False, x.pow(2))):
        codes, absmax = quantize_blockwise(values, signed, 256)
        assert codes.dtype == torch.uint8 and absmax.shape == (12, 1)
        back = dequantize_blockwise(codes, absmax, signed, values.shape)
        assert torch.equal(back.sign(), values.sign()) or (back[values == 0] == 0).all()
        rel = (back - values).abs() / values.abs()
        floor = 1e-6 if signed else 1e-12
        kept = values.abs() > 2 * floor * absmax.repeat_interleave(256)[:3000].squeeze()
        assert rel[kept].max() < 0.06


def test_adamw8bit_matches_adamw_with_a_quarter_of_the_state():
    from workbench.models.architectures import DigitsCNN

    task = wb.tasks.load("digits")
    results = {}
    for name, cls in (("fp32", torch.optim.AdamW), ("8bit", wb.precision.AdamW8bit)):
        torch.manual_seed(0)
        model = DigitsCNN()
        _, opt = wb.training.fit_classifier(model, task, epochs=8, lr=3e-3, progress=False, optimizer_cls=cls,
                                            return_optimizer=True)
        results[name] = (task.evaluate(model)["accuracy"], wb.precision.state_bytes(opt))
    assert results["fp32"][1] / results["8bit"][1] >= 3.5, results
    assert abs(results["fp32"][0] - results["8bit"][0]) <= 0.005, results
    with pytest.raises(ValueError, match="lr must be positive"):
        wb.precision.AdamW8bit(nn.Linear(2, 2).parameters(), lr=0)


def test_gradient_checkpointing_same_gradients_less_memory():
    from workbench.measurement.footprint import peak_allocated_during

    model = wb.models.load("tiny-lm").train()
    ckpt = wb.precision.checkpoint_blocks(model, "h").train()
    x = wb.tasks.load("tiny-lm").example_inputs(8)[0]
    peaks, grads = {}, {}
    for name, m in (("plain", model), ("checkpointed", ckpt)):
        torch.manual_seed(0)
        m.zero_grad()
        peaks[name] = peak_allocated_during(lambda m=m: m(x).float().logsumexp(-1).mean().backward())
        grads[name] = m.lm_head.weight.grad.clone()
    torch.testing.assert_close(grads["checkpointed"], grads["plain"], rtol=1e-4, atol=1e-6)
    assert peaks["checkpointed"] < 0.8 * peaks["plain"], peaks
    with pytest.raises(TypeError, match="not an nn.ModuleList"):
        wb.precision.checkpoint_blocks(model, "ln_f")


class ReadsCastWeights(nn.Module):
    """A parent computing with its children's weights directly, as Mamba (``dt_proj.weight @ x``, a squeezed
    ``conv1d.weight``) and DeBERTa-v2 (a slice of ``rel_embeddings.weight`` through a Linear) do."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.dt = nn.Linear(8, 8, bias=False)

    def forward(self, x):                                   # x: (B, 8) float32
        rows = self.proj(self.table.weight[2:6])            # a slice of a weight, through a (cast) Linear
        return (self.dt.weight @ x.T).T + x @ rows.T.sum(1, keepdim=True)


def test_cast_weights_read_directly_by_the_parent_compute_in_the_callers_dtype(tmp_path):
    """Issue 35: Cast(bf16) on Mamba / DeBERTa-v2 applied, then forward failed with a dtype mismatch. A cast weight
    read outside its layer's forward gives its stored bf16 values in the caller's dtype, as if the layer had been
    called; the model equals the float one computed on the bf16-rounded weights (and so does a reload)."""
    torch.manual_seed(0)
    model = ReadsCastWeights().eval()
    small = wb.apply(model, {"*": wb.precision.Cast(torch.bfloat16)}, progress=False)
    assert {p.dtype for p in small.parameters()} == {torch.bfloat16}
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    x = torch.randn(3, 8)
    with torch.inference_mode():
        got = small(x)
        assert got.dtype == torch.float32
        # only the Linear's activations are rounded to bf16 inside it: close to the float model on bf16 weights
        torch.testing.assert_close(got, rounded(x), rtol=2e-2, atol=2e-2)
    path = tmp_path / "m.safetensors"
    wb.save(small, path)
    again = wb.load(path, base=model)
    with torch.inference_mode():
        assert torch.equal(again(x), got)
    assert wb.size_bytes(small) == sum(p.numel() * 2 for p in model.parameters())
