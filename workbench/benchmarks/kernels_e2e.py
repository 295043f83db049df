"""End-to-end GPU benchmark: whole models with the kernels vs bf16:
``python -m workbench.benchmarks.kernels_e2e [--csv F]``

Two transformer shapes, random initialisation (no weights are downloaded; the numbers are speed and memory,
not accuracy):

- ``minilm``: a BertModel with all-MiniLM-L6-v2's shapes (6 layers, hidden 384, FFN 1536, 12 heads), every
  encoder Linear compressed; batch 1 x 128 and 32 x 128 tokens;
- ``llama``: a LlamaForCausalLM with Llama-3-8B's layer shapes (hidden 4096, FFN 14336, 32 heads, 8 KV heads)
  but 2 layers, the decoder Linears compressed (embeddings and head stay bf16); 1 token (decode-sized M = 1
  through every Linear, no KV cache) and 2048 tokens (prefill).

Paths: bf16 dense; int8 weight-only, int4 g128 weight-only and W8A8 dynamic on the Triton kernels; 2:4 sparse
through ``torch.sparse.to_sparse_semi_structured`` (cuSPARSELt / CUTLASS). Each row: median latency
(``do_bench`` on eager calls, launch overhead included), tokens/s, peak memory of a forward above the model's
own bytes, and the model's bytes (``wb.size_bytes``). `precision_rows` runs ``wb.precision.compare_precisions`` on the
GPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

PATHS = ("bf16", "int8 weight-only", "int4 g128", "w8a8", "2:4 sparse")


def _model(kind: str, device, tiny: bool = False):
    """(model in bf16 on device, Linear-name pattern to compress, token counts to time)."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "minilm":
        cfg = (tf.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128)
               if tiny else tf.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                           intermediate_size=1536, vocab_size=30522))
        with torch.device(device):   # initialised where it runs (a 2-layer Llama is 0.7 B parameters)
            model = tf.BertModel(cfg)
        pattern, sizes = "encoder.*", ((1, 128), (32, 128))
    elif kind == "llama":
        cfg = (tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                              num_hidden_layers=1, vocab_size=256)
               if tiny else tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                           num_key_value_heads=8, num_hidden_layers=2, vocab_size=32000))
        with torch.device(device):
            model = tf.LlamaForCausalLM(cfg)
        pattern, sizes = "model.layers.*", ((1, 1), (1, 2048))
    else:
        raise ValueError(f"unknown model {kind!r}; choose minilm or llama")
    if tiny:
        sizes = tuple((b, min(t, 8)) for b, t in sizes)
    return model.to(device=device, dtype=torch.bfloat16).eval(), pattern, sizes, cfg.vocab_size


def _compressed(model, pattern: str, path: str):
    """A compressed copy of ``model`` (the path's layers on the fast kernel), or the model itself for bf16."""
    import workbench as wb
    from workbench.quantization.modules import W8A8Linear

    Q = wb.quant
    if path == "bf16":
        return model
    if path == "int8 weight-only":
        return wb.apply(model, {pattern: Q.WeightOnly(8, None, kernel="triton")}, progress=False)
    if path == "int4 g128":
        return wb.apply(model, {pattern: Q.WeightOnly(4, 128, kernel="triton")}, progress=False)
    if path == "w8a8":
        # built on the reference path, moved and switched after: W8A8Linear.from_float leaves its buffers on
        # the CPU for a CUDA layer (reported; see docs/kernels.md)
        device = next(model.parameters()).device
        q = wb.apply(model, {pattern: Q.Dynamic(kernel="reference")}, progress=False)
        for m in q.modules():
            if isinstance(m, W8A8Linear):
                m.to(device).set_kernel("triton")
        return q
    if path == "2:4 sparse":
        q = wb.apply(model, {pattern: wb.prune.NM(2, 4, storage="2:4")}, progress=False)
        for m in q.modules():
            if hasattr(m, "set_kernel") and type(m).__name__ == "SemiStructuredLinear":
                m.set_kernel("semi_structured")
        return q
    raise ValueError(f"unknown path {path!r}; choose from {PATHS}")


def model_rows(kinds=("minilm", "llama"), paths=PATHS, device="cuda", tiny: bool = False):
    """One row per (model, path, batch x tokens): latency, tokens/s, peak forward memory, model bytes."""
    import pandas as pd

    import workbench as wb
    from workbench.benchmarks.kernels import _median_ms

    device = torch.device(device)
    rows = []
    for kind in kinds:
        model, pattern, sizes, vocab = _model(kind, device, tiny)
        for path in paths:
            row = {"model": kind, "path": path}
            try:
                m = _compressed(model, pattern, path)
            except Exception as e:  # recorded, never dropped
                rows.append({**row, "note": f"{type(e).__name__}: {str(e)[:160]}"})
                continue
            nbytes = wb.size_bytes(m)
            for batch, tokens in sizes:
                ids = torch.randint(0, vocab, (batch, tokens), device=device)
                fwd = (lambda m=m, ids=ids: m(input_ids=ids, use_cache=False)) if kind == "llama" else \
                      (lambda m=m, ids=ids: m(input_ids=ids))
                try:
                    with torch.inference_mode():
                        fwd()
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                            fwd()
                            peak = torch.cuda.max_memory_allocated() - base
                        else:
                            peak = float("nan")
                        ms = _median_ms(fwd, device, eager=True)   # what a Python caller waits
                except Exception as e:
                    rows.append({**row, "batch": batch, "tokens": tokens,
                                 "note": f"{type(e).__name__}: {str(e)[:160]}"})
                    continue
                rows.append({**row, "batch": batch, "tokens": tokens, "ms": ms,
                             "tokens_per_s": batch * tokens / (ms * 1e-3), "peak_forward_MB": peak / 2**20,
                             "model_MB": nbytes / 2**20, "note": ""})
            del m
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    for kind in kinds:   # speedup over bf16 at the same (model, batch, tokens)
        for (b, t), grp in df[df["model"] == kind].groupby(["batch", "tokens"]):
            base = grp.loc[grp["path"] == "bf16", "ms"]
            if len(base):
                df.loc[grp.index, "speedup"] = float(base.iloc[0]) / grp["ms"]
    return df


DECODE_PLANS = ("bf16", "int8", "int4", "fp8", "w8a8")   # int8 / int4: weight-only; w8a8: dynamic activations
# Llama-3.2-1B's shape (1.24 B parameters, tied embedding), random initialisation
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                max_position_embeddings=4096)


def _decode_model(name: str, device):
    """A causal LM in bf16 on ``device``: the zoo's trained tiny-llama, or ``llama-1b`` (random, `LLAMA_1B`)."""
    import transformers as tf

    import workbench as wb

    if name == "llama-1b":
        torch.manual_seed(0)
        with torch.device(device):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_1B))
    else:
        model = wb.models.load(name)
    return model.to(device=device, dtype=torch.bfloat16).eval()


def _decode_plan(plan: str, model) -> dict:
    """The plan for ``plan``: the decoder layers' Linears (embedding and head stay bf16); int4 in groups of 128
    where every Linear's input width divides by it, else 32."""
    import workbench as wb

    Q = wb.quant
    widths = [m.in_features for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    group = 128 if all(k % 128 == 0 for k in widths) else 32
    configs = {"int8": Q.WeightOnly(8, None, kernel="triton"), "int4": Q.WeightOnly(4, group, kernel="triton"),
               "fp8": Q.FP8(), "w8a8": Q.Dynamic(kernel="triton")}
    if plan not in configs:
        raise ValueError(f"unknown plan {plan!r}; choose from {DECODE_PLANS}")
    return {"model.layers.*": configs[plan]}


def decode_rows(models=("tiny-llama", "llama-1b"), plans=DECODE_PLANS, device="cuda", new_tokens: int = 64,
                prompt_tokens: int = 16, runs: int = 3):
    """Greedy batch-1 decode per (model, plan), through `workbench.measurement.decode.tokens_per_s` - the
    static-cache loop with its step compiled (on a GPU: replayed as a CUDA graph) and eager - with the path that
    ran, any fallback warning, peak memory above the weights during decode, and the model's bytes."""
    import warnings

    import pandas as pd

    import workbench as wb
    from workbench.measurement import decode

    device = torch.device(device)
    rows = []
    for name in models:
        model = _decode_model(name, device)
        for plan in plans:
            row = {"model": name, "plan": plan}
            try:
                m = model if plan == "bf16" else wb.apply(model, _decode_plan(plan, model), progress=False)
            except Exception as e:  # recorded, never dropped
                rows.append({**row, "note": f"apply: {type(e).__name__}: {str(e)[:200]}"})
                continue
            kernels = sorted({str(getattr(x, "kernel", "")) for x in m.modules() if hasattr(x, "kernel")} - {""})
            for compile in (True, False):
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        decode.tokens_per_s(m, 4, prompt_tokens, runs=1, compile=compile)   # compile, warm up
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                        tps = decode.tokens_per_s(m, new_tokens, prompt_tokens, runs=runs, compile=compile)
                        peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else float("nan")
                except Exception as e:
                    rows.append({**row, "compile": compile, "note": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                note = "; ".join(str(w.message)[:200] for w in caught if issubclass(w.category, RuntimeWarning))
                rows.append({**row, "compile": compile, "path": decode._path(m, compile).value,
                             "tokens_per_s": tps, "peak_decode_MB": peak / 2**20,
                             "model_MB": wb.size_bytes(m) / 2**20, "kernels": ",".join(kernels), "note": note})
                print(rows[-1], flush=True)   # (a long run shows each row as it is measured)
            del m
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    if "tokens_per_s" in df:
        for (name, compile), grp in df.groupby(["model", "compile"]):   # speedup over bf16, same model and path
            base = grp.loc[grp["plan"] == "bf16", "tokens_per_s"]
            if len(base):
                df.loc[grp.index, "vs_bf16"] = grp["tokens_per_s"] / float(base.iloc[0])
    return df


def precision_rows(device="cuda", epochs: int = 2):
    """``wb.precision.compare_precisions`` on the digits MLP on ``device``: step time, peak step memory,
    accuracy per precision (a frame with the error in ``note`` if it cannot run there)."""
    import pandas as pd

    import workbench as wb

    try:
        model = wb.models.load("digits-mlp").to(device)
        df = wb.precision.compare_precisions(model, wb.tasks.load("digits"), epochs=epochs, progress=False)
        return df.assign(note="")
    except Exception as e:
        return pd.DataFrame([{"precision": "all", "note": f"{type(e).__name__}: {str(e)[:200]}"}])


def main(argv=None) -> None:
    import pandas as pd

    from workbench.benchmarks.kernels import environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["minilm", "llama"], choices=["minilm", "llama"])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--no-precisions", action="store_true", help="skip compare_precisions")
    p.add_argument("--decode", nargs="*", default=None, choices=["tiny-llama", "llama-1b"],
                   help="greedy decode tokens/s per plan of these models (compiled and eager) instead of the rest")
    p.add_argument("--plans", nargs="+", default=list(DECODE_PLANS), choices=list(DECODE_PLANS))
    p.add_argument("--csv", default="kernels/workbench_kernels/results_e2e.csv")
    a = p.parse_args(argv)
    env = environment()
    print(env)
    if a.decode is not None:
        df = decode_rows(a.decode or ("tiny-llama", "llama-1b"), a.plans)
        print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        out = Path(a.csv)
        out.parent.mkdir(parents=True, exist_ok=True)
        df.assign(part="gpu_decode", environment=env).to_csv(out, index=False)
        print(f"wrote {out}")
        return
    df = model_rows(a.models, a.paths)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    tables = [df.assign(part="gpu_e2e")]
    if not a.no_precisions:
        pr = precision_rows()
        print(pr.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        tables.append(pr.assign(part="gpu_precision"))
    out = Path(a.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.concat(tables).assign(environment=env).to_csv(out, index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
