"""The lean decode path of `workbench.measurement.decode`: the static-cache greedy loop gives `generate`'s tokens
(eager: fp32, int8 and int4 weight-only; compiled: fp32, int4 and cpu-int8), the CPU kernels' custom ops compute
what the eager kernels do, the decode step's passes put the dense GEMV and the decode attention where one row / one
query position runs (and nowhere else), models the loop cannot take keep their path, a failed compile falls back
saying so, and the documented ``wb.measurement.decode`` resolves after ``import workbench``. The compiled fp32 run is
marked ``slow`` (a compile takes 5-25 s on the 2-core machine)."""
import subprocess
import sys

import pytest
import torch

import workbench as wb
from workbench.measurement import decode as D
from workbench.measurement.latency import num_threads
from workbench.quantization.modules import WeightOnlyLinear
from workbench_kernels import ops, weight_only_cpu

CONFIGS = {"fp32": None, "int8": wb.quant.WeightOnly(bits=8, group_size=32),
           "int4 g32": wb.quant.WeightOnly(bits=4, group_size=32)}


@pytest.fixture(scope="module")
def llama():
    return wb.models.load("tiny-llama").eval()


@pytest.fixture(scope="module")
def variants(llama):
    return {name: llama if cfg is None else wb.apply(llama, {"model.layers.*": cfg}, progress=False)
            for name, cfg in CONFIGS.items()}


def _generate(model, ids, n):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, use_cache=True, pad_token_id=0)


def _prompt(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 4096, (1, T), generator=torch.Generator().manual_seed(seed))


def test_readme_attribute_access_after_import_workbench():
    code = "import workbench as wb; assert callable(wb.measurement.decode.tokens_per_second)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_static_cache_loop_gives_generates_tokens(variants, name):
    model, ids = variants[name], _prompt(11)
    assert D.lean_unsupported(model) is None
    out = D.greedy(model, ids, 24, compile=False)
    assert torch.equal(out, _generate(model, ids, 24))
    assert D._path(model, False) is D.DecodePath.STATIC_CACHE


# int4 (the custom op in the graph) in the fast tier: its compile takes ~4-12 s; fp32's ~25 s on a cold cache (int8
# runs the same op as int4: its eager loop is checked above)
@pytest.mark.parametrize("name", [pytest.param("fp32", marks=pytest.mark.slow), "int4 g32"])
def test_compiled_loop_gives_generates_tokens_and_compiles_once(variants, name):
    model = variants[name]
    with num_threads(1):
        for T, n in ((9, 30), (20, 17)):   # two prompts and lengths in one cache bucket: one compiled step
            ids = _prompt(T, seed=T)
            assert torch.equal(D.greedy(model, ids, n), _generate(model, ids, n))
            if T == 9:
                frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames   # no recompile
        speed = D.tokens_per_second(model, _prompt(6), new_tokens=8, repeats=1, threads=1)
    assert speed.path is D.DecodePath.COMPILED and speed.decode_tokens_per_s > 0


def test_a_fresh_quantized_model_compiles_its_step_once_over_generations(llama):
    # its layers build their packed CPU weights on the first forward, after the model's fingerprint was first taken
    model = wb.apply(llama, {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)}, progress=False)
    assert all(m.__dict__.get("_cpu_packed") is None for m in model.modules() if isinstance(m, WeightOnlyLinear))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with num_threads(1):
        for T in (7, 8):
            ids = _prompt(T, seed=T)
            assert torch.equal(D.greedy(model, ids, 12), _generate(model, ids, 12))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1


def test_after_the_first_step_the_loop_skips_dynamos_guards_and_stays_right_across_cache_buckets(variants,
                                                                                                monkeypatch):
    model, stances = variants["int4 g32"], []
    real = torch.compiler.set_stance

    def spy(*args, **kwargs):
        stances.append(kwargs.get("skip_guard_eval_unsafe", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    with num_threads(1):
        # 128-, 256- and again 128-position caches: one compiled entry each, told apart by the guards that differ
        for T, n in ((9, 30), (100, 60), (12, 20)):
            ids = _prompt(T, seed=T)
            before = len(stances)
            assert torch.equal(D.greedy(model, ids, n), _generate(model, ids, n)), (T, n)
            assert stances[before:] == [True], stances   # once a generation, from its second step on
    assert D._path(model, True) is D.DecodePath.COMPILED


# formats whose forward dynamo once could not trace (each fell back to the eager step with a warning): NF4's codebook
# (scipy), a Cast model's CastParameter (str.endswith in its __torch_function__), a quantized embedding and head
@pytest.mark.slow
@pytest.mark.parametrize("plan", [{"model.layers.*": wb.quant.NF4(group_size=32)},
                                  {"*": wb.precision.Cast(torch.bfloat16)},
                                  {"*": wb.quant.WeightOnly(bits=4, group_size=32)}],
                         ids=["nf4", "cast bf16", "int4 all"])
def test_compiled_step_takes_nf4_cast_and_quantized_embeddings(llama, plan):
    import warnings

    model, ids = wb.apply(llama, plan, progress=False), _prompt(7, seed=3)
    with num_threads(1), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # the fallback's warning fails the test
        out = D.greedy(model, ids, 12)
    assert D._path(model, True) is D.DecodePath.COMPILED
    assert torch.equal(out, D.greedy(model, ids, 12, compile=False))


@pytest.mark.slow   # three compiles (~40 s each on 2 cores)
def test_a_changed_model_gets_a_new_compiled_step_and_a_parameter_changed_in_place_needs_none(llama):
    """The compiled step has no guards on the model's modules (`_fingerprint` is compared once a generation
    instead): a module swapped, a new parameter or a changed attribute gives a new step; in-place changes of
    parameters reach the step as they are (its inputs)."""
    import copy

    model, ids = copy.deepcopy(wb.apply(llama, {"model.layers.*": CONFIGS["int4 g32"]}, progress=False)), _prompt(8)
    with num_threads(1):
        D.greedy(model, ids, 6)
        first = D._decoder(model, True)
        with torch.no_grad():   # in place: the same step, the new values
            model.model.norm.weight.mul_(-1.5)
        assert D._decoder(model, True) is first
        assert torch.equal(D.greedy(model, ids, 10), _generate(model, ids, 10))
        model.model.norm.weight = torch.nn.Parameter(torch.randn_like(model.model.norm.weight))   # a new parameter
        assert torch.equal(D.greedy(model, ids, 10), _generate(model, ids, 10))
        second = D._decoder(model, True)
        assert second is not first
        model.model.norm.variance_epsilon = 0.5   # an attribute the traced graph holds as a constant
        assert torch.equal(D.greedy(model, ids, 10), _generate(model, ids, 10))
        assert D._decoder(model, True) is not second


@pytest.mark.slow   # a compile (~20 s on 2 cores)
def test_a_sliding_window_model_whose_window_holds_the_cache_compiles_once():
    """Mistral (every layer a sliding window of 512 positions; the cache 128): the cache's layers are full ones,
    so the step compiles once instead of recompiling every token (the sliding layer's Python length counter) until
    dynamo's limit, and gives generate's tokens."""
    import warnings

    import transformers as tf

    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, sliding_window=512)).eval()
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with num_threads(1), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # the eager fallback's warning fails the test
        out = D.greedy(model, ids, 20)
    assert D._path(model, True) is D.DecodePath.COMPILED
    assert torch.equal(out, _generate(model, ids, 20))


def test_a_failed_compile_falls_back_to_the_eager_loop_with_a_warning(llama, monkeypatch):
    def broken(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("no compiler here")
        return fail

    model = wb.apply(llama, {}, progress=False)   # a model of its own: decoders are cached per model
    monkeypatch.setattr(torch, "compile", broken)
    ids = _prompt(7)
    with pytest.warns(RuntimeWarning, match="torch.compile of LlamaForCausalLM's decode step failed.*no compiler"):
        out = D.greedy(model, ids, 12)
    assert torch.equal(out, _generate(model, ids, 12)) and D._path(model, True) is D.DecodePath.STATIC_CACHE


def test_a_compiled_step_whose_logits_are_wrong_is_refused(llama, monkeypatch):
    def off(fn, **kwargs):   # a "compiled" step one logit of which is off by a tenth of the largest
        def step(model, tok, pos, cache, eos):
            next_tok, logits = fn(model, tok, pos, cache, eos)
            logits[0, 7] += 0.1 * float(logits[torch.isfinite(logits)].abs().max())
            return next_tok, logits
        return step

    model = wb.apply(llama, {}, progress=False)
    monkeypatch.setattr(torch, "compile", off)
    with pytest.warns(RuntimeWarning, match="logits differ from the eager step's at new token 2"):
        out = D.greedy(model, _prompt(7), 12)
    assert torch.equal(out, _generate(model, _prompt(7), 12)) and D._path(model, True) is D.DecodePath.STATIC_CACHE


def test_models_the_loop_cannot_take_keep_their_path(llama):
    tiny_lm = wb.models.load("tiny-lm").eval()
    assert "not a Hugging Face causal LM" in D.lean_unsupported(tiny_lm)
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    out = D.greedy(tiny_lm, ids, 6)
    want = ids
    with torch.inference_mode():
        for _ in range(6):   # the whole context each token, no cache
            want = torch.cat([want, tiny_lm(want)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, want) and D._path(tiny_lm, True) is D.DecodePath.FORWARD
    assert D.tokens_per_s(tiny_lm, new_tokens=2, runs=1) > 0

    penalised = wb.apply(llama, {}, progress=False)
    penalised.generation_config.repetition_penalty = 1.3   # a logits processor the loop does not apply
    assert "repetition_penalty" in D.lean_unsupported(penalised)
    ids = _prompt(8)
    assert torch.equal(D.greedy(penalised, ids, 10), _generate(penalised, ids, 10))
    assert D._path(penalised, True) is D.DecodePath.GENERATE


@pytest.mark.parametrize("bits,group", [(4, 32), (8, None), (4, 64)])
def test_the_custom_op_computes_what_the_eager_kernel_does(bits, group):
    torch.manual_seed(0)
    linear = torch.nn.Linear(200, 77)   # K not a multiple of the group
    layer = WeightOnlyLinear.from_float(linear, wb.quant.WeightOnly(bits=bits, group_size=group).format(),
                                        kernel="cpu")
    w = weight_only_cpu.pack(layer._tensors(), layer.fmt, layer.K)
    args = (w.qweight, w.scale, w.zero, w.lut, linear.bias.detach(), w.bits, w.group_size, w.K,
            [int(r) for r in w.call_rules], w.scale16, w.zconst)
    for shape in ((1, 200), (3, 5, 200), (40, 200)):
        x = torch.randn(shape)
        want = weight_only_cpu.linear_unchecked(x, w, linear.bias.detach())
        assert torch.equal(torch.ops.workbench.weight_only_linear_cpu.default(x, *args), want)
        assert torch.equal(ops.weight_only_linear_cpu(x, w, linear.bias.detach()), want)
    torch.library.opcheck(torch.ops.workbench.weight_only_linear_cpu.default, (torch.randn(2, 200), *args),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_compiled_weight_only_layer_runs_the_kernel_in_its_graph():
    torch.manual_seed(0)
    layer = WeightOnlyLinear.from_float(torch.nn.Linear(96, 40), wb.quant.WeightOnly(bits=4, group_size=32)
                                        .format(), kernel="cpu")
    x = torch.randn(1, 96)
    with torch.inference_mode():
        eager = layer(x)   # packs the weight for the CPU kernel
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)   # fullgraph: no pybind break
    assert torch.equal(compiled, eager)


def test_cpu_int8_layers_compile_into_the_graph_with_the_eager_numbers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    q = wb.apply(model, {"*": wb.quant.WeightOnly(bits=4, group_size=32, kernel="cpu-int8")}, progress=False)
    with torch.inference_mode():
        x, many = torch.randn(1, 96), torch.randn(40, 96)   # 40 rows: rounded in PyTorch ops, the exact kernel's op
        eager, eager_many = q(x), q(many)
        torch._dynamo.reset()
        step = torch.compile(q, fullgraph=True, backend="aot_eager")
        assert torch.equal(step(x), eager)
        torch.testing.assert_close(step(many), eager_many, rtol=1e-5, atol=1e-5)
    args = (q[0].qweight, q[0].scale, None, 8.0, 4, 32, 96, q[0].bias.detach())
    torch.library.opcheck(torch.ops.workbench.act_int8_linear_cpu.default, (torch.randn(2, 96), *args),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_dense_gemv_op_is_linear_on_one_row_and_any_other_input():
    torch.manual_seed(0)
    for N, K in ((37, 203), (8, 256), (5, 17), (64, 40)):   # K with and without a vector tail, N with a row tail
        w, b = torch.randn(N, K), torch.randn(N)
        for x in (torch.randn(1, K), torch.randn(1, 1, K), torch.randn(3, K), torch.randn(1, K).double()):
            for bias in (None, b.to(x.dtype)):
                want = torch.nn.functional.linear(x, w.to(x.dtype), bias)
                got = ops.dense_gemv_cpu(x, w.to(x.dtype), bias)
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * K ** 0.5)
    with pytest.raises(RuntimeError, match=r"dense_gemv_cpu: x \(\.\.\., K = 8\)"):
        ops.dense_gemv_cpu(torch.randn(1, 9), torch.randn(4, 8))
    torch.library.opcheck(torch.ops.workbench.dense_gemv_cpu.default,
                          (torch.randn(1, 64), torch.randn(9, 64), torch.randn(9)))


def test_the_dense_gemv_pass_takes_one_row_linears_only():
    from torch._inductor.utils import run_and_get_code

    from workbench_kernels.isa import inductor_cache_per_capability

    inductor_cache_per_capability()   # (an ATen capability capped by the test tier: inductor's cache of its own)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32, bias=False)).eval()
    for rows, expected_calls in ((1, 2), (3, 0)):
        x = torch.randn(rows, 96)
        torch._dynamo.reset()
        step = torch.compile(model, fullgraph=True,
                             options={"post_grad_custom_post_pass": ops.DenseGemvPass()})
        with torch.inference_mode():
            got, code = run_and_get_code(step, x)
            want = model(x)
        assert "".join(code).count("torch.ops.workbench.dense_gemv_cpu.default(") == expected_calls
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_compiled_decode_step_runs_fp32_linears_on_the_dense_gemv_and_its_attention_on_the_decode_kernel():
    options = D._inductor_options()
    assert isinstance(options["post_grad_custom_post_pass"], ops.DecodeStepPass)
    assert options["size_asserts"] is False


def test_the_decode_step_compiles_with_the_cpp_wrapper_and_falls_back_to_the_python_wrapper(llama, monkeypatch):
    compile = torch.compile
    asked = []

    def cpp_fails(fn, **kwargs):   # inductor's C++ wrapper cannot be built here; its Python wrapper can
        asked.append(kwargs["options"]["cpp_wrapper"])
        if kwargs["options"]["cpp_wrapper"]:
            def fail(*args, **kw):
                raise RuntimeError("no C++ wrapper here")
            return fail
        return compile(fn, **kwargs)

    model = wb.apply(llama, {}, progress=False)
    monkeypatch.setattr(torch, "compile", cpp_fails)
    ids = _prompt(7)
    said = r"failed \(with the C\+\+ wrapper: RuntimeError: no C\+\+ wrapper here\); its step runs with the Python"
    with num_threads(1), pytest.warns(RuntimeWarning, match=said):
        out = D.greedy(model, ids, 12)
    assert asked == [True, False] and D._path(model, True) is D.DecodePath.COMPILED
    assert torch.equal(out, D.greedy(model, ids, 12, compile=False))


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [{}, {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32, kernel="triton")}],
                         ids=["bf16", "int4 triton"])
def test_compiled_decode_on_a_gpu_replays_cuda_graphs_with_the_eager_logits(llama, plan):
    import copy
    import warnings

    model = wb.apply(copy.deepcopy(llama).to("cuda", torch.bfloat16), plan, progress=False)
    ids = _prompt(9).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback (or a failed logits check) fails the test
        out = D.greedy(model, ids, 40)
        again = D.greedy(model, ids, 40)
    decoder = D._decoder(model, True)
    assert decoder.graphs and decoder.path is D.DecodePath.COMPILED
    assert torch.equal(out, again)   # replays are deterministic, and their outputs were not overwritten
    eager = D.greedy(model, ids, 40, compile=False)
    # (bf16 sums in another order may break a near tie late in the text; the first tokens agree)
    assert torch.equal(out[:, :9 + 8], eager[:, :9 + 8])
    assert D.tokens_per_s(model, 16, 8, runs=1) > 0


def _attention_masks(B, H, L, gen):
    keep = torch.rand(B, 1, 1, L, generator=gen) > 0.3
    keep[..., 0] = True
    lowest = torch.finfo(torch.float32).min
    return {"none": None, "bool": keep, "-inf": torch.zeros(B, 1, 1, L).masked_fill(~keep, float("-inf")),
            "lowest float": torch.zeros(B, 1, 1, L).masked_fill(~keep, lowest),   # (transformers' masks)
            "float": torch.randn(B, 1, 1, L, generator=gen).masked_fill(~keep, float("-inf")),
            "per head": torch.randn(B, H, 1, L, generator=gen),
            "all masked": torch.zeros(B, 1, 1, L, dtype=torch.bool),
            "all lowest": torch.full((B, 1, 1, L), lowest)}


def test_the_decode_attention_op_is_attention_of_one_query_with_grouped_heads():
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    # (B, Hq, Hkv, L, Dh): tiny-llama's and llama-480m's heads, D with a vector tail, D over 64 (two column blocks)
    for B, Hq, Hkv, L, Dh in ((1, 4, 2, 128, 80), (1, 32, 4, 128, 64), (2, 4, 4, 33, 17), (1, 4, 1, 300, 130)):
        q = torch.randn(B, Hq, 1, Dh, generator=gen) * 3
        k, v = torch.randn(B, Hkv, L, Dh, generator=gen), torch.randn(B, Hkv, L, Dh, generator=gen)
        for name, mask in _attention_masks(B, Hq, L, gen).items():
            got = ops.decode_attention_cpu(q, k, v, mask)
            assert got.shape == (B, Hq, 1, Dh) and got.is_contiguous()
            if name == "all masked":   # PyTorch's CPU flash attention's answer: zeros
                assert torch.equal(got, torch.zeros_like(got))
                continue
            m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
            want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m64, enable_gqa=True)
            if name == "all lowest":   # every score the same lowest float in fp32: the plain average of v
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            torch.testing.assert_close(got, want.float(), rtol=0, atol=5e-6, msg=f"{(B, Hq, Hkv, L, Dh)} {name}")
    # a strided cache view (rows not D apart), several query positions and fp64: the reference's answer
    k, v = torch.randn(1, 2, 40, 32, generator=gen), torch.randn(1, 2, 40, 32, generator=gen)
    for q, kk, vv in ((torch.randn(1, 4, 1, 16, generator=gen), k[..., :16], v[..., :16]),
                      (torch.randn(1, 4, 3, 32, generator=gen), k, v),
                      (torch.randn(1, 4, 1, 32, generator=gen).double(), k.double(), v.double())):
        want = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True, scale=0.3)
        torch.testing.assert_close(ops.decode_attention_cpu(q, kk, vv, None, 0.3), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"decode_attention_cpu: q \(B, Hq, T, D\)"):
        ops.decode_attention_cpu(torch.randn(1, 3, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    torch.library.opcheck(torch.ops.workbench.decode_attention_cpu.default,
                          (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16),
                           torch.rand(1, 1, 1, 9) > 0.5, None))


def test_the_decode_attention_pass_takes_attention_of_one_query_only():
    from torch._inductor.utils import run_and_get_code

    from workbench_kernels.isa import inductor_cache_per_capability

    inductor_cache_per_capability()
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 24, 16, generator=gen), torch.randn(1, 2, 24, 16, generator=gen)
    mask = torch.arange(24).view(1, 1, 1, 24) < 10

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q * 2, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2)

    for T, expected_calls in ((1, 1), (3, 0)):
        q = torch.randn(1, 4, T, 16, generator=gen)
        torch._dynamo.reset()
        step = torch.compile(attend, fullgraph=True, options={"post_grad_custom_post_pass": ops.DecodeStepPass()})
        with torch.inference_mode():
            got, code = run_and_get_code(step, q, k, v, mask)
        assert "".join(code).count("torch.ops.workbench.decode_attention_cpu.default(") == expected_calls
        torch.testing.assert_close(got, attend(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_compiled_decode_of_a_cpu_int8_llama_gives_its_eager_tokens(llama):
    model = wb.apply(llama, {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32, kernel="cpu-int8")},
                     progress=False)
    ids = _prompt(9, seed=3)
    with num_threads(1), torch.inference_mode():
        compiled = D.greedy(model, ids, 20)
    assert D._path(model, True) is D.DecodePath.COMPILED
    assert torch.equal(compiled, D.greedy(model, ids, 20, compile=False))
