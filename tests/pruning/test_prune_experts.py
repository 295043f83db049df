"""Unstructured pruning (Magnitude, NM, Wanda, SparseGPT) of fused mixture-of-experts experts (issue 35).

Small random transformers 5 models, as in ``tests/quantization/test_experts.py``: Mixtral (experts (E, 2I, H) /
(E, H, I) used as ``F.linear``), GPT-OSS (transposed (E, H, 2I) / (E, I, H) used as ``x @ W``, with per-expert
biases) and Qwen2-MoE (Mixtral's layout beside a shared expert of nn.Linear). Each expert's matrix must be pruned
exactly as the same config prunes an nn.Linear holding it - Wanda / SparseGPT on the tokens routed to that expert,
read here with a hook on the float model -, an expert with too few tokens falls back to magnitude and says so, the
router and the original model stay untouched, and save / load rebuilds the model bit for bit.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from moe_models import CALIBRATION, MODELS, experts_of, logits, mixtral, routed_inputs  # (conftest: path)
from torch import nn

import workbench as wb
from workbench.quantization.experts import MIN_EXPERT_TOKENS, coverage

LAYER = "model.layers.0.mlp.experts"   # the first block's: calibrated on the original model's activations


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def apply(model, plan, calibration=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wb.apply(model, plan, calibration=calibration, progress=False)
    return out, [str(w.message) for w in caught]


def matrix(experts: nn.Module, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s matrix of projection ``name`` as the nn.Linear weight (out, in) it stands for."""
    w = getattr(experts, name)[e].detach()
    return w.t() if experts.is_transposed else w


def as_linear(w: torch.Tensor, config, x: torch.Tensor | None = None) -> torch.Tensor:
    """What ``config`` makes of an nn.Linear holding ``w`` (calibrated on ``x``, if given): its pruned weight."""
    layer = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        layer[0].weight.copy_(w)
    pruned = wb.apply(layer, {"0": config}, calibration=None if x is None else [(x,)], progress=False)
    return pruned[0].weight.detach()


def routed(model: nn.Module, layer: str = LAYER) -> tuple[torch.Tensor, torch.Tensor]:
    return routed_inputs(model, layer)


def intermediate(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """The input of expert ``e``'s ``down_proj`` for tokens ``x``, computed with ``experts``' (pruned) gate / up."""
    if experts.is_transposed:   # GPT-OSS: x @ W + b, gate and up interleaved
        return experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


# --- data-free: Magnitude, N:M -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [wb.prune.Magnitude(0.5), wb.prune.NM(2, 4), wb.prune.Magnitude(0.3, "dense")],
                         ids=["magnitude", "nm-2-4", "magnitude-dense"])
def test_each_expert_is_pruned_as_a_linear_holding_it(model, config):
    pruned, caught = apply(model, {"*": config})
    report = wb.applied_report(pruned).set_index("layer")
    for name, float_experts in experts_of(model).items():
        new = pruned.get_submodule(name)
        assert type(new) is type(float_experts)
        assert report.loc[name, "status"] == "compressed"
        assert "the router stays dense" in report.loc[name, "note"]
        for proj in ("gate_up_proj", "down_proj"):
            assert getattr(new, proj).shape == getattr(float_experts, proj).shape
            for e in range(float_experts.num_experts):
                w = matrix(new, proj, e)
                assert torch.equal(w, as_linear(matrix(float_experts, proj, e), config)), (name, proj, e)
                if config.pattern is None:   # an exact count per expert matrix
                    assert int((w == 0).sum()) == round(config.sparsity * w.numel())
                else:                        # 2 of every 4 consecutive inputs
                    assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all()
        for key in (k for k, _ in float_experts.named_parameters() if k.endswith("_bias")):   # GPT-OSS's biases
            assert torch.equal(getattr(new, key), getattr(float_experts, key))
        assert wb.prune.sparsity_of(pruned)[name] == pytest.approx(
            config.sparsity if config.pattern is None else 0.5, abs=1e-3)   # (each matrix rounds its count)
    assert not any("mlp.experts (" in w for w in caught), caught


# --- calibrated: Wanda, SparseGPT on each expert's routed tokens -------------------------------------------------

@pytest.mark.parametrize("config", [wb.prune.Wanda(0.5), wb.prune.Wanda(nm=(2, 4)), wb.prune.SparseGPT(0.5),
                                    wb.prune.SparseGPT(nm=(2, 4))],
                         ids=["wanda", "wanda-2-4", "sparsegpt", "sparsegpt-2-4"])
def test_calibrated_pruning_scores_each_expert_on_exactly_its_routed_tokens(model, config):
    """gate_up_proj on the tokens the router sent to each expert; down_proj on what the *pruned* gate_up_proj makes
    of them; the coverage table counts those tokens. Bit for bit with the tokens in the order the class's loop
    visits them (first choices, then second); in token order the masks are the same and SparseGPT's weights within
    float32 rounding (its Hessian sums the tokens in another order: measured 1.1e-5 of the largest weight)."""
    pruned, _ = apply(model, {"*": config}, CALIBRATION)
    new, float_experts = pruned.get_submodule(LAYER), model.get_submodule(LAYER)
    hidden, ids = routed(model)
    table = coverage(pruned).set_index(["layer", "projection", "expert"])
    for e in range(float_experts.num_experts):
        x = hidden[(ids == e).any(-1)]                                          # (tokens, H)
        _, visited = torch.where(ids.T == e)                                    # the eager loop's order
        assert x.shape[0] >= MIN_EXPERT_TOKENS
        assert torch.equal(visited.sort().values, (ids == e).any(-1).nonzero()[:, 0])   # the same tokens
        for proj, inputs in (("gate_up_proj", x), ("down_proj", intermediate(new, e, x))):
            assert table.loc[(LAYER, proj, e), "tokens"] == x.shape[0]
            assert table.loc[(LAYER, proj, e), "method"] == type(config).__name__
            dense = matrix(float_experts, proj, e)
            got, want = matrix(new, proj, e), as_linear(dense, config, inputs)
            assert torch.equal(got == 0, want == 0), (proj, e)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            in_order = hidden[visited] if proj == "gate_up_proj" else intermediate(new, e, hidden[visited])
            assert torch.equal(got, as_linear(dense, config, in_order)), (proj, e)
            assert not torch.equal(got == 0, as_linear(dense, wb.prune.Magnitude(0.5)) == 0)   # (not magnitude's)
            assert int((got == 0).sum()) == got.numel() // 2
    note = wb.applied_report(pruned).set_index("layer").loc[LAYER, "note"]
    assert f"{type(config).__name__} per expert on its routed calibration tokens" in note
    assert "magnitude" not in note
    assert torch.isfinite(logits(pruned)).all()


@pytest.mark.parametrize("config, fallback", [(wb.prune.Wanda(0.5), wb.prune.Magnitude(0.5)),
                                              (wb.prune.SparseGPT(nm=(2, 4)), wb.prune.NM(2, 4))],
                         ids=["wanda", "sparsegpt-2-4"])
def test_an_expert_with_too_few_routed_tokens_is_pruned_by_magnitude_and_said_so(config, fallback):
    """3 calibration tokens: no expert of top-2-of-4 routing sees 16 - each gets magnitude pruning at the same
    sparsity (N:M), exactly the data-free config's weights; the coverage table and the note say so; no NaN."""
    model = mixtral()
    few = [(torch.randint(0, 128, (1, 3), generator=torch.Generator().manual_seed(4)),)]
    pruned, _ = apply(model, {"*experts": config}, few)
    reference, _ = apply(model, {"*experts": fallback})
    table = coverage(pruned)
    assert len(table) == 2 * 2 * 4 and (table.method == "magnitude").all() and (table.tokens < MIN_EXPERT_TOKENS).all()
    assert table.tokens.sum() > 0
    for name in experts_of(model):
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(pruned.get_submodule(name), proj), getattr(reference.get_submodule(name), proj))
        note = wb.applied_report(pruned).set_index("layer").loc[name, "note"]
        assert f"saw fewer than {MIN_EXPERT_TOKENS} tokens" in note and "pruned by magnitude" in note
    assert torch.isfinite(logits(pruned)).all()


# --- the rest of the model, round trips, refusals ----------------------------------------------------------------

def test_router_and_original_untouched_runs_in_inference_mode_and_round_trips(model, tmp_path):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = logits(model)
    pruned, _ = apply(model, {"*": wb.prune.Wanda(0.5)}, CALIBRATION)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(model), reference)
    report = wb.applied_report(pruned).set_index("layer")
    routers = [n for n in report.index if n.endswith(("mlp.gate", "mlp.router"))]
    assert routers
    for name in routers:
        assert report.loc[name, "status"] == "passed over"
        assert torch.equal(pruned.get_submodule(name).weight, model.get_submodule(name).weight)
    out = logits(pruned)
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    path = wb.save(pruned, tmp_path / "moe.safetensors")
    loaded = wb.load(path, base=model)
    assert torch.equal(logits(loaded), out)
    for name, experts in experts_of(pruned).items():
        again = loaded.get_submodule(name)
        assert type(again) is type(experts)
        assert all(torch.equal(t, experts.state_dict()[k]) for k, t in again.state_dict().items())
    with wb.empty_weights():   # a base without weights: every value comes from the file
        empty = type(model)(model.config)
    assert torch.equal(logits(wb.load(path, base=empty)), out)


@pytest.mark.parametrize("config", [wb.prune.Magnitude(0.5, storage="csr"), wb.prune.NM(2, 4, storage="2:4")],
                         ids=["csr", "2:4"])
def test_sparse_storages_pass_experts_over_by_a_glob_and_refuse_them_by_name(config):
    model = mixtral()
    pruned, caught = apply(model, {"*": config})
    row = wb.applied_report(pruned).set_index("layer").loc[LAYER]
    assert row.status == "passed over" and f"storage {config.storage!r}" in row.note and "'mask' or 'dense'" in row.note
    assert torch.equal(pruned.get_submodule(LAYER).gate_up_proj, model.get_submodule(LAYER).gate_up_proj)
    with pytest.raises(ValueError, match=rf"{LAYER}.*storage {config.storage!r}"):
        wb.apply(model, {LAYER: config}, progress=False)


def test_global_plan_takes_experts_at_their_share_under_the_threshold():
    model = mixtral()
    plan = wb.prune.global_plan(model, ["*experts", "*proj"], 0.6)
    pruned = wb.apply(model, plan, progress=False)
    sparsity = wb.prune.sparsity_of(pruned)
    assert 0 < sparsity[LAYER] < 1
    total = sum(sparsity[n] * sum(p.numel() for p in model.get_submodule(n).parameters(recurse=False))
                for n in plan.keys())
    whole = sum(sum(p.numel() for p in model.get_submodule(n).parameters(recurse=False)) for n in plan.keys())
    assert total / whole == pytest.approx(0.6, abs=0.01)


def test_finalize_keeps_pruned_experts_dense_and_refuses_a_sparse_storage_naming_them(tmp_path):
    model = mixtral()
    pruned = wb.apply(model, {"*proj": wb.prune.Magnitude(0.5), "*experts": wb.prune.Magnitude(0.5)}, progress=False)
    dense = wb.prune.finalize(pruned, "dense")
    assert torch.equal(dense.get_submodule(LAYER).down_proj, pruned.get_submodule(LAYER).down_proj)
    path = wb.save(dense, tmp_path / "dense.safetensors")
    assert torch.equal(logits(wb.load(path, base=model)), logits(dense))
    with pytest.raises(ValueError, match=rf"'{LAYER}'.*as 'dense'"):
        wb.prune.finalize(pruned, "csr")
