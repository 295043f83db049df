"""Peak memory of an in-place calibrated compression: ``python -m workbench.benchmarks.memory [--layers 12 --hidden 256
--intermediate 512] [--pipeline sequential]``

A random-init bf16 Llama (``LlamaForCausalLM`` from a config; parameters created in bf16, never as an fp32
copy) is GPTQ-quantized in place (int4 g64, every Linear of the blocks) in a fresh subprocess; the growth of
the process's peak resident set (``resource.getrusage``) during `wb.apply` is reported against the model's
bytes. Returns a dict: model_bytes, rss (before apply), peak_before, peak_after, growth, seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import gc, json, resource, sys, time
import torch, transformers
L, H, I, pipeline = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
model = transformers.LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
import workbench as wb
g = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 1024, (4, 128), generator=g),) for _ in range(4)]
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
gc.collect()
rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
plan = {"lm_head": None, "model.embed_tokens": None, "*": wb.quant.WeightOnly(bits=4, group_size=64, method="gptq")}
t0 = time.perf_counter()
small = wb.apply(model, plan, calibration=batches, inplace=True, progress=False, pipeline=pipeline)
took = time.perf_counter() - t0
assert small is model and type(model.model.layers[-1].mlp.down_proj).__name__ == "WeightOnlyLinear"
peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"model_bytes": model_bytes, "rss": rss, "peak_before": peak_before, "peak_after": peak_after,
                  "growth": peak_after - max(rss, peak_before), "seconds": took}))
'''


def bench_inplace_memory(layers: int = 12, hidden: int = 256, intermediate: int = 512,
                         pipeline: str = "sequential", threads: int = 2, timeout: float = 3600) -> dict:
    root = Path(__file__).resolve().parents[2]   # the repository (workbench/benchmarks/memory.py)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(layers), str(hidden), str(intermediate), pipeline],
                         capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the memory benchmark failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--pipeline", default="sequential", choices=["sequential", "original"])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    r = bench_inplace_memory(a.layers, a.hidden, a.intermediate, a.pipeline, a.threads)
    print(json.dumps(r), f"growth / model bytes = {r['growth'] / r['model_bytes']:.2f}")


if __name__ == "__main__":
    main()
