"""Fused mixture-of-experts projections as weight-only layers (issue 35, `workbench.quantization.experts`).

Small random transformers 5 models: Mixtral (experts (E, 2I, H) / (E, H, I) used as ``F.linear``), GPT-OSS
(transposed (E, H, 2I) / (E, I, H) used as ``x @ W``, with per-expert biases and an interleaved gate) and Qwen2-MoE
(Mixtral's layout beside a shared expert made of nn.Linear). ``{"*": WeightOnly(...)}`` takes the experts; each
expert is stored exactly as `WeightOnlyLinear` stores the same matrix; the module computes what the float module
computes on the dequantized weights, decoding only the experts a call routes to; sizes are the bytes the format
says; save / load round-trips; layouts that cannot be told are passed over by a glob and refused by name.
"""
import copy
import math
import warnings

import pytest
import torch
from moe_models import CALIBRATION, MODELS, TOKENS, experts_of, logits, mixtral, routed_inputs  # (conftest: path)
from torch import nn

import workbench as wb
from workbench.quantization.experts import WeightOnlyExperts
from workbench.quantization.modules import WeightOnlyLinear

INT4 = wb.quant.WeightOnly(bits=4, group_size=32)
INT8 = wb.quant.WeightOnly(bits=8)




@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def apply(model, plan):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wb.apply(model, plan, progress=False)
    return out, [str(w.message) for w in caught]


def linear_matrix(float_experts: nn.Module, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s matrix of projection ``name`` as an nn.Linear weight (out, in), read the way the model's
    forward reads it."""
    w = getattr(float_experts, name)[e].detach()
    return w.t() if float_experts.is_transposed else w


def dequantized_float_model(model: nn.Module, quantized: nn.Module) -> nn.Module:
    """``model`` with its expert weights replaced by the quantized model's dequantized ones, run by the eager
    per-expert loop (the path the quantized module runs)."""
    out = copy.deepcopy(model)
    for name, q in experts_of(quantized).items():
        f = out.get_submodule(name)
        with torch.no_grad():
            for m in q.matrices:
                getattr(f, m.name).copy_(q.decode(m.name, torch.arange(m.experts)))
    out.set_experts_implementation("eager")
    return out


# --- the plan takes the experts --------------------------------------------------------------------------------

def test_glob_takes_fused_experts_and_keeps_the_router(model):
    q, caught = apply(model, {"*": INT4})
    report = wb.applied_report(q).set_index("layer")
    for name in experts_of(model):
        assert report.loc[name, "status"] == "compressed"
        assert "router stays in full precision" in report.loc[name, "note"]
        assert isinstance(q.get_submodule(name), WeightOnlyExperts)
        assert isinstance(q.get_submodule(name), type(model.get_submodule(name)))   # a drop-in subclass
        assert not any(p.dim() == 3 for p in q.get_submodule(name).parameters())
    assert not any(f"{name} (" in w for name in experts_of(model) for w in caught), caught
    routers = [n for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]
    assert routers
    for name in routers:
        assert report.loc[name, "status"] == "passed over"
        assert "kept in full precision" in report.loc[name, "note"]
        assert torch.equal(q.get_submodule(name).weight, model.get_submodule(name).weight)
    described = wb.Plan({"*": INT4}).describe(model).set_index("layer")
    assert (described.loc[list(experts_of(model)), "status"] == "compressed").all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [INT4, INT8], ids=["int4", "int8"])
def test_experts_moved_to_a_gpu_compute_there_what_they_compute_on_the_cpu(model, config):
    """The quantized experts (and the rest of the model) moved with ``.cuda()`` run there on their stored codes:
    the logits are the CPU module's within fp32 summation error."""
    from moe_models import TOKENS

    q, _ = apply(model, {"*": config})
    on_gpu = copy.deepcopy(q).cuda()
    stored = next(m for m in on_gpu.modules() if isinstance(m, WeightOnlyExperts))
    assert all(t.is_cuda for t in stored.state_dict().values())
    with torch.inference_mode():
        got = on_gpu(TOKENS.cuda()).logits.cpu()
    assert relative(got, logits(q)) < 1e-4


def test_size_is_what_the_bytes_say(model):
    """Every matrix int4 with groups of 32 (codes: half a byte per value; an fp16 scale per group), the rest fp32:
    the model's size is exactly that sum."""
    q, _ = apply(model, {"*": INT4})
    taken = set(wb.applied_report(q).query("status == 'compressed'").layer)

    def int4(rows: int, K: int) -> int:
        return rows * (math.ceil(K / 2) + 2 * math.ceil(K / 32))

    expected = sum(b.numel() * b.element_size() for b in model.buffers())   # (rotary tables)
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if name in taken and p.dim() == 3:               # (E, out, in), or (E, in, out) transposed
                E, a, b = p.shape
                expected += E * (int4(b, a) if module.is_transposed else int4(a, b))
            elif name in taken and pname == "weight":
                expected += int4(*p.shape)
            else:
                expected += p.numel() * p.element_size()    # norms, routers, biases: as they were
    assert wb.size_bytes(q) == expected
    assert wb.size_bytes(q) / wb.size_bytes(model) < 0.16   # (0.144 Mixtral, 0.155 GPT-OSS, 0.148 Qwen2-MoE)


# --- each expert is a WeightOnlyLinear -------------------------------------------------------------------------

@pytest.mark.parametrize("config", [INT4, INT8, wb.quant.WeightOnly(bits=4, group_size=48, symmetric=False),
                                    wb.quant.NF4(group_size=32)], ids=["int4", "int8", "int4-asym-short", "nf4"])
def test_each_expert_is_a_weight_only_linear_bit_for_bit(model, config):
    q, _ = apply(model, {"*experts": config})
    fmt = config.format()
    for name, float_experts in experts_of(model).items():
        packed = q.get_submodule(name)
        for m in packed.matrices:
            lazy = getattr(packed, m.name)
            assert lazy.shape == getattr(float_experts, m.name).shape
            for e in range(m.experts):
                w = linear_matrix(float_experts, m.name, e)
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight.data.copy_(w)
                ref = WeightOnlyLinear.from_float(linear, fmt, kernel="reference")
                for key, t in packed.stored(m.name).items():
                    assert torch.equal(t[e], getattr(ref, key)), (name, m.name, e, key)
                decoded = lazy[e]
                assert torch.equal(decoded.t() if m.transposed else decoded, ref.dequantized_weight())
            ids = torch.tensor([2, 0, 2, 3])   # a batch of expert ids (batched_mm's gather)
            assert torch.equal(lazy[ids], torch.stack([lazy[int(i)] for i in ids]))
            assert torch.equal(lazy[-1], lazy[m.experts - 1])
            with pytest.raises(IndexError):
                lazy[m.experts]


# --- what it computes ------------------------------------------------------------------------------------------

def test_forward_is_the_float_modules_on_random_routing_decoding_only_routed_experts(model, monkeypatch):
    q, _ = apply(model, {"*experts": INT4})
    reference = dequantized_float_model(model, q)
    gen = torch.Generator().manual_seed(2)
    name, packed = next(iter(experts_of(q).items()))
    packed.set_kernel("reference")   # decode, then the class's matmuls (the CPU kernel path: the next test)
    float_experts = reference.get_submodule(name)
    T, H, k = 24, model.config.hidden_size, 2
    hidden = torch.randn(T, H, generator=gen)
    routed = torch.tensor([0, 2, 3])                   # expert 1 gets no token
    index = torch.stack([routed[torch.randperm(3, generator=gen)[:k]] for _ in range(T)])   # (T, k) distinct
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    decoded: list[tuple[str, list[int]]] = []
    decode = packed.decode
    monkeypatch.setattr(packed, "decode", lambda n, ids: decoded.append((n, ids.tolist())) or decode(n, ids))
    with torch.no_grad():
        out = packed(hidden, index, weights)
        expected = float_experts(hidden, index, weights)
    assert torch.equal(out, expected)
    per_matrix = {m.name: sorted(e for n, ids in decoded if n == m.name for e in ids) for m in packed.matrices}
    assert per_matrix == {m.name: routed.tolist() for m in packed.matrices}   # each routed expert once, no other
    grouped = copy.deepcopy(float_experts)
    grouped.config = copy.copy(grouped.config)
    grouped.config._experts_implementation = "grouped_mm"   # what the model runs by default: the same, up to rounding
    with torch.no_grad():
        torch.testing.assert_close(grouped(hidden, index, weights), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [INT4, INT8], ids=["int4", "int8"])
def test_logits_exact_on_dequantized_weights_and_close_to_float(model, config):
    """Exactly the float model whose expert weights are the dequantized ones (same routing: the same numbers
    reach the routers); within 2x the relative output error quantization gives one dense layer of the same
    matrix (measured: Mixtral 0.19x, GPT-OSS 1.4x, Qwen2-MoE 0.06x at int4)."""
    q, _ = apply(model, {"*experts": config})
    got = logits(q)
    assert torch.equal(got, logits(dequantized_float_model(model, q)))
    float_experts = next(iter(experts_of(model).values()))
    w = linear_matrix(float_experts, "gate_up_proj", 0)
    dense = nn.Linear(w.shape[1], w.shape[0], bias=False)
    dense.weight.data.copy_(w)
    x = torch.randn(256, w.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense_error = relative(WeightOnlyLinear.from_float(dense, config.format(), kernel="reference")(x), dense(x))
    assert relative(got, logits(model)) < 2 * dense_error
    # every layer: runs under inference_mode, stays close (cosine measured at int4: Mixtral 0.987, GPT-OSS 0.955 - a
    # token routed to another expert after attention's error -, Qwen2-MoE 0.986; int8: 0.99995 all three)
    full, _ = apply(model, {"*": config})
    cosine = torch.nn.functional.cosine_similarity(logits(full).flatten(), logits(model).flatten(), dim=0)
    assert cosine > (0.94 if config.bits == 4 else 0.999)


def test_save_load_round_trip_gives_identical_logits(model, tmp_path):
    q, _ = apply(model, {"*": INT4})
    path = wb.save(q, tmp_path / "moe.safetensors")
    with wb.empty_weights():   # a base without weights: every value comes from the file
        base = type(model)(model.config)
    loaded = wb.load(path, base=base)
    assert isinstance(next(iter(experts_of(loaded).values())), WeightOnlyExperts)
    assert torch.equal(logits(loaded), logits(q))
    assert wb.size_bytes(loaded) == wb.size_bytes(q)


def test_copies_and_dtype_moves_keep_the_stored_format():
    q, _ = apply(mixtral(), {"*experts": INT4})
    copied = copy.deepcopy(q)
    assert torch.equal(logits(copied), logits(q))
    packed = copy.deepcopy(next(iter(experts_of(q).values()))).to(torch.bfloat16)
    assert packed.gate_up_proj.dtype == torch.bfloat16 and packed.gate_up_proj[0].dtype == torch.bfloat16
    assert packed.gate_up_proj_scale.dtype == torch.float16 and packed.gate_up_proj_qweight.dtype == torch.uint8


# --- what cannot be represented ---------------------------------------------------------------------------------

class AmbiguousExperts(nn.Module):
    """gate / up / down as separate (E, I, H) / (E, H, I) tensors with no ``is_transposed`` flag: which dimension
    is the input cannot be told from the shapes."""

    def __init__(self, experts: int = 4, hidden: int = 32, inner: int = 48):
        super().__init__()
        self.num_experts = experts
        self.gate_proj = nn.Parameter(torch.randn(experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.randn(experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.experts = AmbiguousExperts()


def test_unknown_layout_is_passed_over_by_a_glob_and_refused_by_name():
    model = Toy()
    q, caught = apply(model, {"*": INT4})
    row = wb.applied_report(q).set_index("layer").loc["experts"]
    assert row.status == "passed over" and "cannot be told" in row.note
    assert any("experts (AmbiguousExperts" in w and "cannot be told" in w for w in caught), caught
    with pytest.raises(ValueError, match="'experts'.*AmbiguousExperts"):
        wb.apply(model, {"experts": INT4}, progress=False)
    hqq = wb.quant.WeightOnly(bits=4, group_size=32, symmetric=False, method="hqq")   # a method experts lack
    reason = wb.Plan({"*": hqq}).describe(mixtral()).set_index("layer").loc["model.layers.0.mlp.experts", "reason"]
    assert "round to nearest, GPTQ (without act_order) or AWQ" in reason


def test_projections_that_do_not_chain_are_refused():
    bad = AmbiguousExperts()
    bad.is_transposed = False
    bad.down_proj = nn.Parameter(torch.randn(4, 48, 32))   # (E, I, H): not (E, H, I) as is_transposed=False says
    config = wb.quant.WeightOnly(4, 32)
    from workbench.plans.registry import handler_for

    assert not handler_for(config).supports(bad, config)
    assert "do not chain" in handler_for(config).why_not(bad, config)
    bad.down_proj = nn.Parameter(torch.randn(4, 32, 48))
    assert handler_for(config).supports(bad, config)


def test_qat_passes_over_fused_experts_out_loud_and_refuses_them_by_name(tmp_path):
    """QAT fake-quantizes 2-D weights: a glob passes the fused experts over with a warning naming them (they stay
    full precision through convert, and the saved plan says so: the reload is the same model); an exact name is
    refused naming the module."""
    model = mixtral()
    with pytest.warns(UserWarning, match=r"passed over 2 fused mixture-of-experts module\(s\) \(model.layers.0"):
        prepared = wb.qat.prepare(model, wb.Plan({"*": INT8}))
    small = wb.qat.convert(prepared)
    assert type(small.model.layers[0].mlp.experts) is type(model.model.layers[0].mlp.experts)
    assert isinstance(small.model.layers[0].self_attn.q_proj, WeightOnlyLinear)
    path = tmp_path / "m.safetensors"
    wb.save(small, path)
    with torch.inference_mode():
        assert torch.equal(wb.load(path, base=model)(TOKENS).logits, small(TOKENS).logits)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts' \(MixtralExperts\): QAT"):
        wb.qat.prepare(model, wb.Plan({"model.layers.1.mlp.experts": INT8}))


# --- calibrated per expert: GPTQ on the tokens routed to each expert ----------------------------------------

GPTQ4 = wb.quant.WeightOnly(bits=4, group_size=32, method="gptq")




AWQ4 = wb.quant.WeightOnly(bits=4, group_size=32, method="awq")


def _gptq(w, x):
    from workbench.quantization.gptq import gptq_quantize

    return gptq_quantize(w, [(x,)], GPTQ4.format(), damp=GPTQ4.damp)


def _awq(w, x):
    from workbench.quantization.awq import awq_search

    tensors, smooth, _ = awq_search(w, [(x,)], AWQ4.format())
    return {**tensors, "smooth": smooth.float()}


@pytest.mark.parametrize("config, reference", [(GPTQ4, _gptq), (AWQ4, _awq)], ids=["gptq", "awq"])
def test_calibrated_methods_quantize_each_expert_on_exactly_its_routed_tokens(model, config, reference):
    """The first block's experts (whose inputs the sequential pipeline takes from the original model): each
    expert's first projection holds exactly the codes (and AWQ's factors) the method gives its matrix on the tokens
    the router sent to it; the coverage table counts those tokens; the error beats round to nearest's on the
    model's logits."""
    from workbench.quantization import formats as fm
    from workbench.quantization.experts import coverage

    layer = "model.layers.0.mlp.experts"
    method = config.method.value.upper()
    q = wb.apply(model, {"*": config}, calibration=CALIBRATION, progress=False)
    experts = q.get_submodule(layer)
    first = experts.matrices[0]
    hidden, ids = routed_inputs(model, layer)
    table = coverage(q).set_index(["layer", "projection", "expert"])
    float_experts = model.get_submodule(layer)
    for e in range(first.experts):
        x = hidden[torch.where(ids.t() == e)[1]]   # its tokens, in the order the class's loop visits them
        assert table.loc[(layer, first.name, e), "tokens"] == x.shape[0]
        if x.shape[0] < wb.quant.experts.MIN_EXPERT_TOKENS:
            continue
        assert table.loc[(layer, first.name, e), "method"] == method
        want = reference(linear_matrix(float_experts, first.name, e), x)
        got = {k: t[e] for k, t in experts.stored(first.name).items()}
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want if k != "smooth"), e
        if "smooth" in want:   # (AWQ's factors: a mean over the tokens, summed in another order: 1 ulp)
            torch.testing.assert_close(got["smooth"], want["smooth"], rtol=1e-6, atol=0)
        assert not torch.equal(want["qweight"], fm.encode(linear_matrix(float_experts, first.name, e),
                                                          GPTQ4.format())["qweight"])   # (not RTN's codes)
    note = wb.applied_report(q).set_index("layer").loc[layer, "note"]
    assert f"{method} per expert on its routed calibration tokens" in note
    rtn = wb.apply(model, {"*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    with torch.inference_mode():
        ref, by_gptq, by_rtn = (m(*CALIBRATION[0]).logits for m in (model, q, rtn))
    assert (by_gptq - ref).pow(2).mean() < (by_rtn - ref).pow(2).mean()


def test_an_expert_with_too_few_routed_tokens_is_rounded_to_nearest_and_said_so():
    """Calibration on 3 tokens: no expert of top-2-of-4 routing can see 16 - each is rounded to nearest (the very
    codes of WeightOnly's RTN), the coverage table and the report say so; no NaN anywhere."""
    from workbench.quantization.experts import coverage

    model = mixtral()
    few = [(torch.randint(0, 128, (1, 3), generator=torch.Generator().manual_seed(4)),)]
    q = wb.apply(model, {"*": GPTQ4}, calibration=few, progress=False)
    rtn = wb.apply(model, {"*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    table = coverage(q)
    assert len(table) == 2 * 2 * 4 and (table.method == "rtn").all() and (table.tokens < 16).all()
    assert table.tokens.sum() > 0
    for name in experts_of(model):
        for m in q.get_submodule(name).matrices:
            for k, t in q.get_submodule(name).stored(m.name).items():
                assert torch.equal(t, rtn.get_submodule(name).stored(m.name)[k])
        assert "rounded to nearest" in wb.applied_report(q).set_index("layer").loc[name, "note"]
    assert torch.isfinite(logits(q)).all()


def test_gptq_experts_with_act_order_are_passed_over_by_a_glob_and_refused_by_name():
    model = mixtral()
    plan = wb.quant.WeightOnly(bits=4, group_size=32, method="gptq", act_order=True)
    with pytest.warns(UserWarning, match=r"model.layers.0.mlp.experts \(MixtralExperts.*act_order=True"):
        wb.apply(model, {"*": plan}, calibration=CALIBRATION, progress=False)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts"):
        wb.apply(model, {"model.layers.0.mlp.experts": plan}, calibration=CALIBRATION, progress=False)


def test_cast_stores_the_experts_in_bf16_and_computes_on_their_values(model, tmp_path):
    """Cast(bf16) takes the fused experts (half the bytes) and the router stays fp32; the model equals the float
    model whose expert weights were rounded to bf16 (each expert's slice read in fp32), and reloads bit for bit."""
    q = wb.apply(model, {"*": wb.precision.Cast(torch.bfloat16)}, progress=False)
    rounded = copy.deepcopy(model)
    for name, experts in experts_of(q).items():
        own = dict(experts.named_parameters(recurse=False))   # the 3-D experts and (GPT-OSS) their biases
        assert any(p.dim() == 3 for p in own.values()) and all(p.dtype == torch.bfloat16 for p in own.values())
        with torch.no_grad():
            for k, p in own.items():
                rounded.get_submodule(name).get_parameter(k).copy_(p.float())
    rounded.set_experts_implementation("eager")   # (the cast experts run the class's eager per-expert loop)
    only_experts = wb.apply(model, {"re:.*mlp\\.experts": wb.precision.Cast(torch.bfloat16)}, progress=False)
    assert torch.equal(logits(only_experts), logits(rounded))
    routers = [n for n, m in q.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]
    assert routers and all(q.get_submodule(n).weight.dtype == torch.float32 for n in routers)
    path = tmp_path / "m.safetensors"
    wb.save(q, path)
    assert torch.equal(logits(wb.load(path, base=model)), logits(q))


# --- W8A8 on the experts ----------------------------------------------------------------------------------------

def test_dynamic_w8a8_experts_quantize_each_products_activations_per_token(model, tmp_path):
    """Dynamic W8A8 takes the experts: int8 weights (WeightOnly(bits=8)'s codes), and each product with an expert's
    matrix runs on the per-token int8 values of its input - the model differs from int8 weight-only (activations
    are quantized) yet stays close to the float one; reload bit for bit."""
    from workbench.quantization.primitives import quantize_per_token

    q = wb.apply(model, {"*": wb.quant.Dynamic()}, progress=False)
    w8 = wb.apply(model, {"*": INT8}, progress=False)
    kernel_out = logits(q)   # (on the CPU: each routed expert's int8 codes on the kernel, activations int8 first)
    for name in experts_of(model):
        q.get_submodule(name).set_kernel("reference")   # decode, then the class's matmuls: checked by hand below
    for name in experts_of(model):
        experts = q.get_submodule(name)
        assert type(experts).__name__.startswith("W8A8") and isinstance(experts, type(model.get_submodule(name)))
        for m in experts.matrices:
            for key, t in experts.stored(m.name).items():
                assert torch.equal(t, w8.get_submodule(name).stored(m.name)[key])
        first = experts.matrices[0]
        w = getattr(experts, first.name)[1]                       # expert 1's matrix, as the forward reads it
        x = torch.randn(5, first.K)
        codes, scale = quantize_per_token(x)
        plain = w.as_subclass(torch.Tensor)
        got = x @ w if first.transposed else torch.nn.functional.linear(x, w)
        want = (codes.float() * scale) @ plain if first.transposed else \
            torch.nn.functional.linear(codes.float() * scale, plain)
        assert torch.equal(got, want) and not torch.equal(got, x @ plain if first.transposed else x @ plain.t())
    out, by_w8 = logits(q), logits(w8)
    assert not torch.equal(out, by_w8) and relative(out, logits(model)) < 0.02
    # the kernel path: the same int8 activations and codes (a code can flip where the paths' fp32 sums differ)
    assert relative(kernel_out, out) < 5e-3
    path = tmp_path / "m.safetensors"
    wb.save(q, path)
    again = wb.load(path, base=model)
    assert torch.equal(logits(again), kernel_out)


def test_static_w8a8_experts_calibrate_a_scale_per_expert_on_its_routed_tokens():
    """Static W8A8: each expert's activation scale is the min-max scale of the tokens routed to it (read
    independently from a hook on the float model); with too few tokens, the scale of all the projection's tokens,
    said in the coverage table and the note."""
    from workbench.quantization.observers import MinMax

    model = mixtral()
    layer = "model.layers.0.mlp.experts"
    q = wb.apply(model, {"*": wb.quant.Static()}, calibration=CALIBRATION, progress=False)
    hidden, ids = routed_inputs(model, layer)
    scales = q.get_submodule(layer).get_buffer("gate_up_proj_act_scale")
    for e in range(4):
        observer = MinMax()
        observer.observe(hidden[(ids == e).any(-1)].float())
        assert torch.equal(scales[e], observer.qparams(8, symmetric=True)[0].reshape(()))
    few = [(torch.randint(0, 128, (1, 3), generator=torch.Generator().manual_seed(4)),)]
    q = wb.apply(model, {"*": wb.quant.Static()}, calibration=few, progress=False)
    table = wb.quant.experts.coverage(q)
    assert (table.method == "all tokens").all()
    assert "take the scale of all its tokens" in wb.applied_report(q).set_index("layer").loc[layer, "note"]
    assert torch.isfinite(logits(q)).all()


@pytest.mark.parametrize("config", [INT4, AWQ4], ids=["int4", "awq"])
def test_routed_experts_run_on_the_cpu_kernel_without_decoding(model, config, monkeypatch):
    """On the CPU (default kernel "auto"), each routed expert's products run workbench_kernels.weight_only_cpu on
    that expert's packed codes - one kernel call per routed expert and projection, nothing decoded - and give the
    reference path's output (decode, then the class's matmul) to fp32 rounding."""
    from workbench_kernels import weight_only_cpu

    q = wb.apply(model, {"*experts": config}, calibration=CALIBRATION, progress=False)
    name, packed = next(iter(experts_of(q).items()))
    gen = torch.Generator().manual_seed(3)
    T, H, k = 24, model.config.hidden_size, 2
    hidden = torch.randn(T, H, generator=gen)
    index = torch.stack([torch.tensor([0, 2, 3])[torch.randperm(3, generator=gen)[:k]] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    with torch.inference_mode():
        reference = copy.deepcopy(packed).set_kernel("reference")(hidden, index, weights)
    calls, decoded = [], []
    kernel = weight_only_cpu.linear_unchecked
    monkeypatch.setattr(weight_only_cpu, "linear_unchecked",
                        lambda x, w, b, **kw: calls.append(x.shape) or kernel(x, w, b, **kw))
    decode = packed.decode
    monkeypatch.setattr(packed, "decode", lambda n, ids: decoded.append(n) or decode(n, ids))
    with torch.inference_mode():
        out = packed(hidden, index, weights)
    assert len(calls) == 3 * len(packed.matrices) and not decoded
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_dtype, cast", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)],
                         ids=["bf16-model-fp16-cast", "fp16-model-bf16-cast"])
def test_cast_experts_of_a_low_precision_model_compute_in_its_dtype(model_dtype, cast, tmp_path):
    """A bf16 / fp16 model: each expert's slice is read in the model's dtype (the weight's source dtype), not the
    default fp32 (which failed at forward with a dtype mismatch); a pickled copy keeps the eager loop."""
    model = mixtral().to(model_dtype)
    q = wb.apply(model, {"re:.*mlp\\.experts": wb.precision.Cast(cast)}, progress=False)
    out = logits(q)
    assert out.dtype == model_dtype and torch.isfinite(out).all()
    assert relative(out.float(), logits(model).float()) < 0.05
    torch.save(q, tmp_path / "m.pt")
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    experts = again.model.layers[0].mlp.experts
    assert experts.forward.module is experts
    assert torch.equal(logits(again), out)


def test_the_cpu_kernel_cache_follows_a_state_dict_loaded_in_inference_mode():
    """The packed views the CPU path caches are made again when other values are loaded, even into inference
    tensors written in place (no version counter to compare)."""
    model = mixtral()
    with torch.inference_mode():
        q = wb.apply(model, {"*experts": INT4}, progress=False)
        before = logits(q)                                         # fills the cache
        other = wb.apply(mixtral_with_seed(5), {"*experts": INT4}, progress=False)
        q.load_state_dict(other.state_dict())
        got = logits(q)
    for name in experts_of(q):
        q.get_submodule(name).set_kernel("reference")
    want = logits(q)
    assert relative(before, want) > 1e-2   # (other values: a stale cache would be this far off)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def mixtral_with_seed(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = mixtral()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model
