"""Peak memory of an in-place calibrated compression: ``python -m workbench.benchmarks.memory [--arch llama-200m |
tinyllama-1.1b] [--layers 12 --hidden 256 --intermediate 512] [--samples 16 --seq 256] [--pipeline sequential]``

A random-init bf16 Llama (``LlamaForCausalLM`` from a config; parameters created in bf16, never as an fp32
copy) is GPTQ-quantized in place (int4 g64, every Linear of the blocks) in a fresh subprocess on ``samples``
random sequences of ``seq`` tokens (batches of 4); the growth of the process's peak resident set
(``resource.getrusage``) during `wb.apply` is reported against the model's bytes. ``--load`` then saves the
result and measures, in another fresh subprocess, the peak of ``wb.load`` on a meta-device base against the
file's bytes. Returns a dict: params, model_bytes, rss (before apply), peak_before, peak_after, growth,
seconds (and load_* entries).

Presets (``--arch``): ``llama-200m`` (16 layers, 1024 wide, 2816 MLP, 16 / 8 heads, 32000 tokens: 190 M
parameters in the blocks), ``tinyllama-1.1b`` (TinyLlama-1.1B's shape: 22 layers, 2048 wide, 5632 MLP,
32 / 4 heads, 32000 tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHS = {
    "llama-200m": dict(num_hidden_layers=16, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000),
    "tinyllama-1.1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000),
}

_PEAK = '''
def peak():   # the process's peak resident set so far, in bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
'''

APPLY = r'''
import gc, json, resource, sys, time
import torch, transformers
''' + _PEAK + r'''
cfg = json.loads(sys.argv[1])
samples, seq, pipeline, save = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
cfg = transformers.LlamaConfig(max_position_embeddings=max(512, seq), tie_word_embeddings=False, **cfg)
model = transformers.LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
import workbench as wb
g = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, cfg.vocab_size, (min(4, samples - i), seq), generator=g),) for i in range(0, samples, 4)]
params = sum(p.numel() for p in model.parameters())
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
gc.collect()
before, peak_before = rss(), peak()
plan = {"lm_head": None, "model.embed_tokens": None, "*": wb.quant.WeightOnly(bits=4, group_size=64, method="gptq")}
t0 = time.perf_counter()
small = wb.apply(model, plan, calibration=batches, inplace=True, progress=False, pipeline=pipeline)
took = time.perf_counter() - t0
assert small is model and type(model.model.layers[-1].mlp.down_proj).__name__ == "WeightOnlyLinear"
peak_after = peak()
if save:
    wb.save(model, save)
print(json.dumps({"params": params, "model_bytes": model_bytes, "rss": before, "peak_before": peak_before,
                  "peak_after": peak_after, "growth": peak_after - max(before, peak_before), "seconds": took}))
'''

LOAD = r'''
import gc, json, os, resource, sys, time
import torch, transformers
''' + _PEAK + r'''
cfg, path = json.loads(sys.argv[1]), sys.argv[2]
import workbench as wb
cfg = transformers.LlamaConfig(max_position_embeddings=512, tie_word_embeddings=False, **cfg)
torch.set_default_dtype(torch.bfloat16)
with wb.empty_weights():
    base = transformers.LlamaForCausalLM(cfg)
torch.set_default_dtype(torch.float32)
gc.collect()
before, peak_before = rss(), peak()
t0 = time.perf_counter()
model = wb.load(path, base=base)
took = time.perf_counter() - t0
peak_after = peak()
x = torch.randint(0, cfg.vocab_size, (1, 8))
with torch.inference_mode():   # every weight read once (a tensor mapped from the file would count from here)
    assert torch.isfinite(model(x).logits).all()
print(json.dumps({"file_bytes": os.path.getsize(path), "rss": before, "peak_after": peak_after,
                  "growth": peak_after - max(before, peak_before), "seconds": took,
                  "growth_after_forward": peak() - max(before, peak_before)}))
'''


def _run(script: str, args: list[str], threads: int, timeout: float) -> dict:
    root = Path(__file__).resolve().parents[2]   # the repository (workbench/benchmarks/memory.py)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the memory benchmark failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_inplace_memory(arch: str | dict = "llama-200m", samples: int = 16, seq: int = 256,
                         pipeline: str = "sequential", threads: int = 2, load: bool = False,
                         timeout: float = 3600) -> dict:
    '''In-place GPTQ of a random-init bf16 Llama (``arch``: a preset name or LlamaConfig fields) in a fresh
    process; ``load``: then `wb.load` of the saved file on an `empty_weights` base in another fresh process
    (``load_*`` entries: file_bytes, growth, seconds).'''
    cfg = ARCHS[arch] if isinstance(arch, str) else dict(arch)
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "model.safetensors") if load else ""
        r = _run(APPLY, [json.dumps(cfg), str(samples), str(seq), pipeline, path], threads, timeout)
        if load:
            r.update({f"load_{k}": v for k, v in _run(LOAD, [json.dumps(cfg), path], threads, timeout).items()})
    return r


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llama-200m", choices=sorted(ARCHS))
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pipeline", default="sequential", choices=["sequential", "original"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", action="store_true", help="also measure wb.load of the saved int4 file")
    a = p.parse_args(argv)
    cfg = dict(ARCHS[a.arch])
    overrides = (("num_hidden_layers", a.layers), ("hidden_size", a.hidden), ("intermediate_size", a.intermediate))
    for key, value in overrides:
        if value is not None:
            cfg[key] = value
    r = bench_inplace_memory(cfg, a.samples, a.seq, a.pipeline, a.threads, a.load)
    line = f"growth / model bytes = {r['growth'] / r['model_bytes']:.2f}"
    if a.load:
        line += f"; load growth / file bytes = {r['load_growth'] / r['load_file_bytes']:.2f}"
    print(json.dumps(r), line)


if __name__ == "__main__":
    main()
