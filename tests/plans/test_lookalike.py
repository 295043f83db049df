"""Look-alike layers (issue 35): a subclass with its own forward is taken when it computes its parent's computation
(checked on a probe input), kept with a known step around it (an embedding's constant scale, rows computed from its
arguments), and otherwise passed over by a glob - with the reason in the report and the warning - and refused by an
exact name. Small random transformers models: Falcon (``FalconLinear``), Gemma-2 (a scaled word embedding), OPT
(learned positions with an offset)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.plans.lookalike import OutputScale, RowsFromForward, computation


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _apply(model, plan, calibration=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = wb.apply(model, wb.Plan(plan), calibration=calibration, progress=False)
    return new, [str(w.message) for w in caught]


def _ids(vocab: int = 96, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def _falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    cfg = FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96, bias=True)
    return FalconForCausalLM(cfg).eval()


# ---------------------------------------------------------------- Falcon: a look-alike that computes nn.Linear's

@pytest.mark.parametrize("config, min_cosine", [
    (wb.quant.WeightOnly(bits=4, group_size=32), 0.95),   # 4-bit weights
    (wb.precision.Cast(torch.bfloat16), 0.999),           # 8 mantissa bits
    (wb.lowrank.SVD(rank=16), 0.5),                       # rank 16 of 64 on random weights (flat spectra)
    (wb.prune.Wanda(sparsity=0.5), 0.9),                  # half of each row's weights, calibrated
], ids=["weight-only-int4", "cast-bf16", "svd", "wanda"])
def test_falcon_linear_is_taken_as_linear(config, min_cosine):
    from transformers.models.falcon.modeling_falcon import FalconLinear

    model, ids = _falcon(), _ids()
    lookalikes = [n for n, m in model.named_modules() if type(m) is FalconLinear]
    assert len(lookalikes) == 8
    found = computation(model.get_submodule(lookalikes[0]))
    assert found.taken and found.parent is nn.Linear and found.transform is None
    new, warned = _apply(model, {"*": config}, calibration=[(ids,)])
    report = wb.applied_report(new).set_index("layer")
    assert (report.loc[lookalikes, "status"] == "compressed").all()
    assert all(type(new.get_submodule(n)) is not FalconLinear for n in lookalikes)
    assert not any("FalconLinear" in w for w in warned)
    with torch.inference_mode():
        before, after = model(ids).logits, new(ids).logits
    assert torch.isfinite(after).all() and not torch.equal(before, after)
    assert _cosine(after, before) >= min_cosine


# ---------------------------------------------------------------- look-alikes that compute something else

class PlusOne(nn.Linear):
    """An nn.Linear subclass whose forward adds 1."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + 1


class TwiceTransposed(nn.Linear):
    """A square nn.Linear subclass that multiplies by W^T twice."""

    def forward(self, x):
        return x @ self.weight.T @ self.weight.T


class Squared(nn.Embedding):
    """An nn.Embedding subclass whose forward squares the looked-up rows."""

    def forward(self, idx):
        return super().forward(idx) ** 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = Squared(40, 16)
        self.plain = nn.Linear(16, 16)
        self.plus_one = PlusOne(16, 16)
        self.twice = TwiceTransposed(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, idx):
        return self.head(self.twice(self.plus_one(self.plain(self.emb(idx)))))


def _net():
    torch.manual_seed(0)
    return Net().eval(), (torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2)),)


CONFIGS = [wb.quant.WeightOnly(bits=4, group_size=16), wb.quant.NF4(group_size=16), wb.quant.FP8(), wb.quant.Dynamic(),
           wb.precision.Cast(torch.bfloat16), wb.lowrank.SVD(rank=2), wb.prune.Wanda(sparsity=0.5),
           wb.prune.SparseGPT(sparsity=0.5)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_other_computation_is_passed_over_by_a_glob_with_the_reason(config):
    model, inputs = _net()
    new, warned = _apply(model, {"*": config}, calibration=[inputs])
    report = wb.applied_report(new).set_index("layer")
    assert report.loc["plain", "status"] == "compressed" and report.loc["head", "status"] == "compressed"
    for name, kind in [("plus_one", "PlusOne"), ("twice", "TwiceTransposed")]:
        assert report.loc[name, "status"] == "passed over"
        assert "does not compute nn.Linear's" in report.loc[name, "note"], report.loc[name, "note"]
        assert type(new.get_submodule(name)).__name__ == kind
        assert any(f"{name} ({kind}" in w and "does not compute nn.Linear's" in w for w in warned), warned
    with torch.inference_mode():
        assert torch.isfinite(new(*inputs)).all()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("layer", ["plus_one", "twice"])
def test_other_computation_is_refused_by_an_exact_name(config, layer):
    model, inputs = _net()
    with pytest.raises(ValueError, match=rf"'{layer}'.*does not compute nn.Linear's"):
        wb.apply(model, wb.Plan({layer: config}), calibration=[inputs], progress=False)


def test_the_probe_bound_separates_rounding_from_another_computation():
    """A subclass computing x @ W.T + b (Falcon's form: another summation order than F.linear) is within the
    rounding bound; adding 1e-3 to it is not. The verdict is cached per instance."""

    class Shifted(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias + 1e-3

    from transformers.models.falcon.modeling_falcon import FalconLinear

    same, shifted = FalconLinear(300, 7), Shifted(300, 7)
    assert computation(same).taken and computation(same) is computation(same)
    assert "differs by up to 0.001" in computation(shifted).reason


def test_unknown_embedding_is_passed_over_and_refused_by_name():
    model, inputs = _net()
    new, warned = _apply(model, {"*": wb.quant.WeightOnly(bits=4, group_size=16)})
    report = wb.applied_report(new).set_index("layer")
    assert report.loc["emb", "status"] == "passed over" and "neither nn.Embedding's lookup" in report.loc["emb", "note"]
    assert any("emb (Squared" in w for w in warned)
    with pytest.raises(ValueError, match=r"'emb'.*neither nn.Embedding's lookup"):
        wb.apply(model, wb.Plan({"emb": wb.precision.Cast(torch.bfloat16)}), progress=False)


# ---------------------------------------------------------------- Gemma-2 and OPT: embeddings with a known step

def _gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=96)
    return Gemma2ForCausalLM(cfg).eval()


def _opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
                    max_position_embeddings=32, word_embed_proj_dim=32)
    return OPTForCausalLM(cfg).eval()


@pytest.mark.parametrize("config, min_cosine", [(wb.quant.WeightOnly(bits=4, group_size=32), 0.93),
                                                (wb.precision.Cast(torch.bfloat16), 0.999)], ids=["int4", "bf16"])
def test_gemma2_scaled_embedding_keeps_its_scale(config, min_cosine, tmp_path):
    model, ids = _gemma2(), _ids()
    emb = model.model.embed_tokens
    found = computation(emb)
    assert isinstance(found.transform, OutputScale) and float(found.transform.scale) == float(emb.embed_scale)
    new, _ = _apply(model, {"*": config})
    report = wb.applied_report(new).set_index("layer")
    assert report.loc["model.embed_tokens", "status"] == "compressed"
    assert "output scale x5.65685" in report.loc["model.embed_tokens", "note"]
    small = new.model.embed_tokens
    with torch.inference_mode():
        # the compressed lookup times the same constant, exactly
        assert torch.equal(small(ids), F.embedding(ids, small.weight.float()) * emb.embed_scale)
        before, after = model(ids).logits, new(ids).logits
    assert _cosine(after, before) >= min_cosine
    wb.save(new, tmp_path / "m.safetensors")
    again = wb.load(tmp_path / "m.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, after)


@pytest.mark.parametrize("config, min_cosine", [(wb.quant.WeightOnly(bits=4, group_size=32), 0.95),
                                                (wb.precision.Cast(torch.bfloat16), 0.999)], ids=["int4", "bf16"])
def test_opt_learned_positions_keep_their_offset(config, min_cosine, tmp_path):
    model, ids = _opt(), _ids()
    pos = model.model.decoder.embed_positions
    assert isinstance(computation(pos).transform, RowsFromForward)
    new, _ = _apply(model, {"*": config})
    report = wb.applied_report(new).set_index("layer")
    assert report.loc["model.decoder.embed_positions", "status"] == "compressed"
    small = new.model.decoder.embed_positions
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0                                                      # left padding
    positions = (mask.cumsum(1) * mask - 1) + pos.offset                 # OPT's rows, offset 2
    with torch.inference_mode():
        assert torch.equal(small(mask, 0), F.embedding(positions, small.weight.float()))
        before, after = model(ids).logits, new(ids).logits
    assert _cosine(after, before) >= min_cosine
    wb.save(new, tmp_path / "m.safetensors")
    again = wb.load(tmp_path / "m.safetensors", base=model)
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, after)


def test_embedding_step_refused_where_it_cannot_be_kept():
    """QAT trains the plain embedding: it cannot keep Gemma-2's scale, and says so naming the layer."""
    model = _gemma2()
    with pytest.raises(ValueError, match=r"'model.embed_tokens'.*cannot keep that step"):
        wb.qat.prepare(model, wb.Plan({"model.embed_tokens": wb.quant.WeightOnly(bits=8),
                                       "lm_head": wb.quant.WeightOnly(bits=8)}))   # (tied: both, or neither)
