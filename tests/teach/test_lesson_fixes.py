"""The four corrected lesson statements, measured by the package (issue 23), and the exercise checkers fed
plausible wrong implementations, which they must reject with a specific hint."""
import math

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.pruning import masks
from workbench.teach import distillation as D
from workbench.teach import precision as P
from workbench.teach import pruning as PR
from workbench.teach import qat as Q


class _TinyLM(nn.Module):   # embeddings -> Linear -> Linear: a small language model autocast can run
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc1, self.fc2 = nn.Embedding(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.emb(x))))


def test_fp16_autocast_loses_weight_gradients_and_loss_scaling_rescues_them():
    model = _TinyLM()
    with torch.no_grad():
        model.fc2.weight.mul_(1e-5)     # tiny upstream gradients: weight gradients of fc1 ~1e-8 and below
    x = torch.randint(0, 16, (2, 8))
    y = torch.randint(0, 16, (2, 8))
    table = P.autocast_underflow(model, x, y, torch.float16, scales=[1.0, 2.0 ** 16])
    assert table.loc[("weights", "2^0"), "lost (→ 0)"] > 0
    assert table.loc[("weights", "2^0"), "median fp32 |g| of the lost"] < 2.0 ** -24
    assert table.loc[("activations", "2^0"), "lost (→ 0)"] > 0
    assert table.loc[("weights", "2^16"), "lost (→ 0)"] < table.loc[("weights", "2^0"), "lost (→ 0)"] / 10
    ref = P.autocast_gradients(model, x, y, torch.float32)
    again = P.autocast_gradients(model, x, y, torch.float32, scale=4.0)
    torch.testing.assert_close(again["weights"], ref["weights"])   # scaling and unscaling is exact in fp32
    assert all(p.grad is None for p in model.parameters())          # no gradients left on the user's model


def test_symmetric_2bit_grid_is_nearly_ternary_and_asymmetric_baseline_is_stronger():
    torch.manual_seed(0)
    w = torch.randn(64, 288)
    sym, asym = Q.code_usage(w, 2, symmetric=True), Q.code_usage(w, 2, symmetric=False)
    assert sum(sym.values()) == sum(asym.values()) == w.numel()
    assert sym[-2] < 0.02 * w.numel() < asym[-2]    # the symmetric grid barely uses its most negative code
    model, task = wb.models.load("digits-mlp"), wb.tasks.load("digits")
    table = Q.ptq_baselines(model, task, ["*"], 2, calibration=task.calibration(64), kernel="reference")
    assert list(table.index) == ["RTN symmetric", "RTN asymmetric", "GPTQ (Linear) + RTN asymmetric (conv)"]
    assert table.loc["RTN asymmetric", "accuracy"] > table.loc["RTN symmetric", "accuracy"]
    assert table.loc["GPTQ (Linear) + RTN asymmetric (conv)", "accuracy"] >= \
        table.loc["RTN asymmetric", "accuracy"] - 0.02


def test_t_squared_is_the_high_temperature_limit():
    torch.manual_seed(0)
    teacher, student = 6 * torch.randn(64, 10), torch.randn(64, 10)   # a trained teacher's spread
    grads = D.soft_gradient_norms(student, teacher, [1, 2, 4, 8, 64, 128])
    table = D.t_squared_table(grads)
    assert table.loc[4, "measured shrink from T=1"] < 16 / 1.5            # far from T² at small T
    assert table.loc[128, "measured shrink from the previous T"] == pytest.approx(4.0, rel=0.05)  # the limit
    assert D.logit_spread(teacher) > D.logit_spread(student)
    assert len(D.t_squared_figure(table, D.logit_spread(teacher)).data) == 2


def test_nm_grouping_measures_the_conv_grouping():
    w = wb.models.load("digits-cnn").conv2.weight
    g = PR.nm_grouping(w)
    assert g.iloc[0, 1] == 1.0 and g.iloc[1, 1] < 0.6 and g.iloc[0, 0] == g.iloc[1, 0] == w.numel() // 2
    with pytest.raises(ValueError, match="convolution weight"):
        PR.nm_grouping(torch.randn(4, 8))


# --- the checkers reject plausible wrong implementations -------------------------------------------------------

def test_nm_mask_checker_rejects_the_flattened_grouping():
    w = wb.models.load("digits-cnn").conv2.weight.detach()
    right = masks.nm_mask(w, 2, 4)
    assert PR.check_nm_mask(right, w).passed
    flat = masks.nm_mask(w.reshape(w.shape[0], -1), 2, 4).reshape(w.shape)
    fb = PR.check_nm_mask(flat, w)
    assert not fb.passed and "flattened" in fb.hint
    assert "True means kept" in PR.check_nm_mask(~right, w).hint
    assert PR.check_nm_mask(..., w).status == "not attempted"


def test_global_mask_checker_rejects_a_per_layer_threshold():
    model = wb.models.load("digits-cnn")
    weights = {n: model.get_submodule(n).weight.detach() for n in ("conv1", "conv2", "conv3", "fc1")}
    pruned = wb.apply(model, wb.prune.global_plan(model, ["conv*", "fc1"], 0.7), progress=False)
    assert PR.check_global_mask(pruned.conv1.mask.bool(), weights, 0.7, "conv1").passed
    fb = PR.check_global_mask(masks.magnitude_mask(weights["conv1"], 0.7), weights, 0.7, "conv1")
    assert not fb.passed and "on its own" in fb.hint


def test_entropy_and_restoring_factor_checkers_reject_plausible_mistakes():
    logits = torch.tensor([6.0, 1.0, -2.0, 0.5, 3.0, -1.0, 0.0, 2.0, -3.0, 1.5])
    temps = [1, 2, 4, 8]
    bits = [float(D.entropy(torch.softmax(logits / t, -1))) for t in temps]
    assert D.check_entropies(bits, logits, temps).passed
    nats = [b * math.log(2) for b in bits]
    assert "nats" in D.check_entropies(nats, logits, temps).hint
    assert "T = 1" in D.check_entropies([bits[0]] * 4, logits, temps).hint
    torch.manual_seed(0)
    grads = D.soft_gradient_norms(torch.randn(32, 10), 4 * torch.randn(32, 10), temps)
    measured = grads["gradient norm (KL alone)"].iloc[0] / grads["gradient norm (KL alone)"].loc[4]
    assert D.check_restoring_factor(measured, grads, 4.0).passed
    fb = D.check_restoring_factor(16.0, grads, 4.0)          # Hinton's T², taken as exact
    assert not fb.passed and "high-temperature limit" in fb.hint
    assert "other way round" in D.check_restoring_factor(1 / measured, grads, 4.0).hint


def test_lesson_50_ceiling_divides_weight_bytes_by_weight_bytes():
    """The bench's byte-ratio ceiling leaves the bias out of both sides: int4 with an fp16 scale per 64 weights
    is 32 / 4.25 = 7.53 (not fp32 weight bytes over quantized bytes with bias)."""
    from workbench.benchmarks.kernels import cpu_layer_table

    t = cpu_layer_table({"small": (128, 64)}, ms=(1,), rounds=1, paths=("fp32", "int4 g64 weight-only"))
    ceiling = t.set_index("path")["ceiling"]
    assert ceiling["fp32"] == 1.0 and ceiling["int4 g64 weight-only"] == pytest.approx(32 / 4.25)


def test_int4_pack_checker_rejects_swapped_nibbles_and_wrong_dtype():
    from workbench.quantization.packing import pack, unpack
    from workbench.teach import kernels as K

    codes = torch.randint(0, 16, (4, 16), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    right = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    assert K.check_int4_pack(right, codes).passed and torch.equal(unpack(pack(codes, 4), 4, 16), codes)
    swapped = (codes[:, 0::2] << 4) | codes[:, 1::2]
    assert "swapped" in K.check_int4_pack(swapped, codes).hint
    assert "uint8" in K.check_int4_pack(right.to(torch.int32), codes).hint
    assert "adding" in K.check_int4_pack(codes[:, 0::2] + codes[:, 1::2], codes).hint


def _int4_linear(x, stored, g, *, order="low first", zero=8, scales="interleave"):
    """The int4 g64 reference path as a learner writes it (bit ops on the packed bytes); keywords make the slips."""
    q = stored["qweight"].to(torch.int64)
    pair = [q & 15, q >> 4] if order == "low first" else [q >> 4, q & 15]
    codes = torch.stack(pair, dim=-1).flatten(1).float()
    s = stored["scale"].float()
    s = s.repeat_interleave(g, dim=1) if scales == "interleave" else s.repeat(1, g)
    return x @ ((codes - zero) * s).T


def test_int4_linear_checker_is_the_package_decode_and_rejects_layout_slips():
    from workbench.quantization import formats
    from workbench.teach import kernels as K

    stored = K.int4_layer(96, 256, group_size=64, seed=1)
    assert stored["qweight"].shape == (96, 128) and stored["scale"].shape == (96, 4)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    right = _int4_linear(x, stored, 64)
    torch.testing.assert_close(right, x @ formats.decode(stored, formats.IntFormat(4, 64), 256).T)
    assert K.check_int4_linear(right, x, stored, 64).passed
    assert K.check_int4_linear(..., x, stored, 64).status == "not attempted"
    fb = K.check_int4_linear(_int4_linear(x, stored, 64, order="high first"), x, stored, 64)
    assert fb.status == "failed" and "nibbles are swapped" in fb.hint and "values differ" in fb.message
    assert "zero point 8" in K.check_int4_linear(_int4_linear(x, stored, 64, zero=0), x, stored, 64).hint
    assert "repeat_interleave" in K.check_int4_linear(_int4_linear(x, stored, 64, scales="tile"), x, stored, 64).hint
    assert "one row per row of x" in K.check_int4_linear(right.T, x, stored, 64).hint


def test_group_quantizer_checker_rejects_a_per_row_scale_a_qmax_scale_and_a_missing_clamp():
    from workbench.teach import basics as B

    torch.manual_seed(0)
    w = torch.randn(8, 256)
    g = w.reshape(-1, 64)
    s = g.abs().amax(dim=1, keepdim=True) / 7.5
    assert B.check_group_quantizer(((g / s).round().clamp(-8, 7) * s).reshape(w.shape), w).passed
    row = w.abs().amax(dim=1, keepdim=True) / 7.5
    assert "one scale per row" in B.check_group_quantizer((w / row).round().clamp(-8, 7) * row, w).hint
    s7 = g.abs().amax(dim=1, keepdim=True) / 7
    assert "divides by" in B.check_group_quantizer(((g / s7).round().clamp(-8, 7) * s7).reshape(w.shape), w).hint
    assert "no clamp" in B.check_group_quantizer(((g / s).round() * s).reshape(w.shape), w).hint
