"""Run an exported GGUF in llama.cpp itself (through llama-cpp-python): the runtime the file is made for.

    small = wb.apply(wb.models.load("tiny-llama"), {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)})
    folder = wb.export(small, "tiny-llama-q4", format="gguf")
    runtime = LlamaCpp(folder, threads=2)
    runtime.logits([1, 2, 3])            # (3, vocab) float32: llama.cpp's logits for every position
    runtime.greedy([1, 2, 3], 16)        # 16 new token ids, argmax decoding with llama.cpp's KV cache
    runtime.threads = 1                  # from the next call on (llama_set_n_threads: no reload)

`decode_table` times greedy decoding of the same weights in llama.cpp and in the workbench's own CPU kernels side by
side (interleaved rounds, one thread count at a time): ``python -m workbench.export.llama_cpp``.

llama-cpp-python is compiled from source by ``make install`` (it is published as a source package only): llama.cpp
for this machine's CPU (``GGML_NATIVE``) without its AMX matrix kernels, whose int8 path crashes (SIGSEGV in
``ggml_backend_amx_mul_mat``) on Q8_0 and Q4_0 models of this size with llama-cpp-python 0.3.36 - llama.cpp's own
quantizer's files included - so llama.cpp runs its AVX-512 / AVX2 kernels there.

What llama.cpp computes differently from the workbench, on the same weights: its quantized matrix products quantize
the activations too (each row in blocks of 32 to int8 with an fp16 scale ``max|x| / 127`` - Q8_0, ggml's
``vec_dot_type`` of Q4_0 / Q4_1 / Q8_0 weights), and its KV cache is fp16 unless ``kv_type="f32"``. Its logits are
therefore close to, not equal to, the workbench's; with the activation rounding simulated on the workbench's side,
the remaining difference is fp32 rounding order (tests/export/test_llama_cpp.py states and checks both).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from workbench.export.gguf import FILE_NAME

__all__ = ["LlamaCpp", "decode_table", "main"]

KV_TYPES = {"f32": 0, "f16": 1}   # ggml_type of the KV cache (GGML_TYPE_F32, GGML_TYPE_F16)


class LlamaCpp:
    """A GGUF file (or an exported folder holding ``model.gguf``) loaded by llama.cpp, on the CPU.

    ``threads``: llama.cpp's threads for decoding and prompt processing (default: torch's thread count, the
    workbench's setting), also settable afterwards (``runtime.threads = n``, read back from llama.cpp); ``context``:
    the KV cache's length in tokens (default: the file's context length); ``kv_type``: the KV cache's element type,
    ``"f16"`` (llama.cpp's default) or ``"f32"``; ``flash_attention``: llama.cpp's fused attention (off by default,
    as llama-cpp-python has it; on, it rounds through fp16).
    """

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, context: int | None = None,
                 kv_type: str = "f16", flash_attention: bool = False):
        import llama_cpp

        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        self.path = path
        n = int(threads or torch.get_num_threads())
        self._llm = llama_cpp.Llama(str(path), n_ctx=int(context or 0), n_threads=n,
                                    n_threads_batch=n, logits_all=True, verbose=False,
                                    type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type],
                                    flash_attn=bool(flash_attention))
        self._lib = llama_cpp
        self.vocab = int(self._llm.n_vocab())
        # llama.cpp rounds its cache up (to 256 tokens); the positions the model has embeddings / was made for are
        # the file's context length: what `greedy` and `logits` allow
        self.context = int(context or self._llm._model.n_ctx_train())

    @property
    def threads(self) -> int:
        """llama.cpp's threads for decoding (prompt processing uses as many), as its context reports them."""
        return int(self._lib.llama_n_threads(self._llm._ctx.ctx))

    @threads.setter
    def threads(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"threads must be a positive int, got {n!r}")
        if n != self.threads:   # llama.cpp hands the count to its CPU backend on every decode: no reload
            self._lib.llama_set_n_threads(self._llm._ctx.ctx, n, n)

    @property
    def metadata(self) -> dict[str, str]:
        """The file's scalar GGUF metadata as llama.cpp reads it (key -> value as text), e.g.
        ``general.architecture``, ``tokenizer.ggml.eos_token_id``."""
        return dict(self._llm.metadata)

    def close(self) -> None:
        self._llm.close()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, tokens: Sequence[int], new: int = 0) -> list[int]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("llama.cpp needs at least one prompt token")
        bad = [t for t in tokens if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab} ({self.path})")
        if len(tokens) + new > self.context:
            raise ValueError(f"{len(tokens)} prompt + {new} new tokens exceed the context of {self.context} tokens "
                             f"(LlamaCpp(context=...))")
        return tokens

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """llama.cpp's logits ``(len(tokens), vocab)`` float32 for a fresh sequence (the KV cache is reset)."""
        tokens = self._check(tokens)
        self._llm.reset()
        self._llm.eval(tokens)
        return torch.from_numpy(np.array(self._llm.scores[:len(tokens)], dtype=np.float32))

    def greedy(self, prompt: Sequence[int], new_tokens: int, *, stop_tokens: Sequence[int] = (),
               min_new_tokens: int = 0) -> list[int]:
        """``new_tokens`` token ids by argmax decoding after ``prompt``: the prompt in one batch, then one token per
        step through llama.cpp's KV cache. By default there is no stop at an end-of-text token; ``stop_tokens`` end
        the sequence (the stop token is the last id returned), and are not chosen before ``min_new_tokens`` new
        tokens (their logits masked, as Hugging Face's ``min_new_tokens`` does)."""
        prompt = self._check(prompt, new_tokens)
        stops = [int(t) for t in stop_tokens]
        llm, lib = self._llm, self._lib
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        out: list[int] = []
        batch = prompt
        for step in range(new_tokens):
            llm.eval(batch)
            row = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm._ctx.ctx, len(batch) - 1), shape=(self.vocab,))
            if stops and step < min_new_tokens:
                row = row.copy()
                row[stops] = -np.inf
            out.append(int(row.argmax()))
            if out[-1] in stops:
                break
            batch = out[-1:]
        return out

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """llama.cpp's tokenization of ``text`` with the file's vocabulary (no bos / eos added)."""
        return self._llm.tokenize(text.encode(), add_bos=False, special=special)


def _greedy_workbench(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    from workbench.measurement.decode import greedy

    return greedy(model, prompt, new_tokens)[0, prompt.shape[1]:].tolist()


def decode_table(model: str = "tiny-llama", formats: Sequence[str] = ("q8_0", "q4_0"),
                 threads: Sequence[int] = (1, 2), new_tokens: int = 64, prompt_tokens: int = 8, rounds: int = 5,
                 folder: str | os.PathLike | None = None):
    """Tokens per second of greedy batch-1 decoding of the same weights in llama.cpp (from the workbench's GGUF) and
    in the workbench's own CPU kernels (``kernel="auto"``), and fp32 in PyTorch as the baseline: for each thread count
    the paths run in interleaved rounds (`workbench.kernels.bench_cpu.interleaved`), median / min / max.

    ``formats``: ``q8_0`` = ``WeightOnly(bits=8, group_size=32)``, ``q4_0`` = ``WeightOnly(bits=4, group_size=32)``
    on every decoder layer's Linear (embedding and head stay fp32 in both runtimes). Each row also says whether the
    two runtimes generated the same tokens (they need not: llama.cpp also quantizes the activations)."""
    import tempfile

    import pandas as pd

    import workbench as wb
    from workbench.kernels.bench_cpu import interleaved
    from workbench.measurement import num_threads
    from workbench.measurement.decode import vocab_size

    configs = {"q8_0": wb.quant.WeightOnly(bits=8, group_size=32), "q4_0": wb.quant.WeightOnly(bits=4, group_size=32)}
    unknown = [f for f in formats if f not in configs]
    if unknown:
        raise ValueError(f"formats {unknown} unknown; known: {sorted(configs)}")
    base = wb.models.load(model)
    layers = "model.layers.*" if hasattr(base, "model") and hasattr(base.model, "layers") else None
    if layers is None:
        raise TypeError(f"decode_table needs a Llama-style zoo model (model.layers.*); {model!r} is a "
                        f"{type(base).__name__}")
    smalls = {f: wb.apply(base, {layers: configs[f]}, progress=False) for f in formats}
    prompt = torch.randint(1, vocab_size(base), (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        paths = {f: wb.export(s, Path(tmp) / f, format="gguf") for f, s in smalls.items()}
        for n in threads:
            runtimes = {f: LlamaCpp(p, threads=n, context=prompt_tokens + new_tokens) for f, p in paths.items()}
            try:
                calls = {"fp32 (PyTorch)": functools.partial(_greedy_workbench, base, prompt, new_tokens)}
                for f in formats:
                    calls[f"{f} workbench"] = functools.partial(_greedy_workbench, smalls[f], prompt, new_tokens)
                    calls[f"{f} llama.cpp"] = functools.partial(runtimes[f].greedy, prompt[0].tolist(), new_tokens)
                with num_threads(n), torch.inference_mode():
                    tokens = {p: c() for p, c in calls.items()}
                    times = interleaved(calls, rounds, warmup=1)
            finally:
                for r in runtimes.values():
                    r.close()
            for p, t in times.items():
                tps = [new_tokens / (v * 1e-3) for v in t]
                f = p.split()[0]
                other = f"{f} workbench" if p.endswith("llama.cpp") else f"{f} llama.cpp"
                rows.append({"model": model, "threads": n, "path": p, "tokens_per_s": statistics.median(tps),
                             "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                             "same_tokens_as_other_runtime": tokens[p] == tokens[other] if other in tokens else None,
                             "new_tokens": new_tokens, "rounds": rounds})
    df = pd.DataFrame(rows)
    fp32 = df[df["path"] == "fp32 (PyTorch)"].set_index("threads")["tokens_per_s"]
    df["vs_fp32"] = df["tokens_per_s"] / df["threads"].map(fp32)
    return df


def main(argv=None) -> None:
    import importlib.metadata

    from workbench.kernels.bench import environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    print(environment())
    print(f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')}")
    df = decode_table(a.model, threads=a.threads, new_tokens=a.new_tokens, rounds=a.rounds)
    print(df.drop(columns=["model", "new_tokens", "rounds"]).to_string(index=False, float_format=lambda v: f"{v:.3g}"))


if __name__ == "__main__":
    main()
