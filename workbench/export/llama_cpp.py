"""Run an exported GGUF in llama.cpp itself (through llama-cpp-python): the runtime the file is made for.

    small = wb.apply(wb.models.load("tiny-llama"), {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)})
    folder = wb.export(small, "tiny-llama-q4", format="gguf")
    runtime = LlamaCpp(folder, threads=2)
    runtime.logits([1, 2, 3])            # (3, vocab) float32: llama.cpp's logits for every position
    runtime.greedy([1, 2, 3], 16)        # 16 new token ids, argmax decoding with llama.cpp's KV cache
    runtime.threads = 1                  # from the next call on (llama_set_n_threads: no reload)

`decode_table` is the yardstick: greedy decoding of the same weights in llama.cpp and in the workbench side by side
(fp32 / Q8_0 / Q4_0, interleaved rounds, one thread count at a time), each figure beside the read-bandwidth ceiling
measured in the same rounds (``torch.sum`` over 1 GiB) and the share of it the path reaches, on a zoo model or the
built-in random-init ``llama-480m`` (TinyLlama-1.1B's shape with 8 layers):
``python -m workbench.export.llama_cpp [--model llama-480m] [--formats f32 q8_0 q4_0] [--rounds 5]``.

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
import dataclasses
import functools
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from workbench.export.gguf import FILE_NAME

__all__ = ["LlamaCpp", "BUILT_IN", "FORMATS", "built_in_model", "decode_table", "gguf_bytes_per_token",
           "kv_bytes_per_token", "main", "weight_bytes_per_token"]

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


# --- the yardstick: decode speed of the same weights in llama.cpp and the workbench ------------------------------

LLAMA_480M: dict = {   # TinyLlama-1.1B's shape with 8 layers: 483 M parameters, untied head (as TinyLlama)
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
BUILT_IN = {"llama-480m": LLAMA_480M}   # model name -> Llama config of a random-init model built in code
FORMATS: dict[str, int | None] = {"f32": None, "q8_0": 8, "q4_0": 4}   # format -> WeightOnly bits (None: fp32)
GROUP = 32                  # WeightOnly(group_size=32): one ggml block per group
BANDWIDTH_BYTES = 1 << 30   # the read-bandwidth probe: torch.sum over 1 GiB of fp32
BASELINE = "fp32 (PyTorch)"


def built_in_model(name: str, seed: int = 0) -> nn.Module:
    """The random-init fp32 ``LlamaForCausalLM`` named ``name`` in `BUILT_IN` (seeded; torch's global RNG is left
    as it was). Nothing is downloaded."""
    from workbench.models.llama import build

    if name not in BUILT_IN:
        raise ValueError(f"no built-in model {name!r}; built in: {sorted(BUILT_IN)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build(BUILT_IN[name])


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of the model's tensors one decode step reads: every module's own parameters and buffers as stored
    (each Linear - the head included, tied or not - quantized codes with their scales, norms, biases), except that
    an embedding contributes one row (``bytes / num_embeddings``)."""
    from workbench.quantization.modules import WeightOnlyEmbedding

    total = 0
    for m in model.modules():
        own = {id(t): t for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
        n = sum(t.numel() * t.element_size() for t in own.values())
        total += n // m.num_embeddings if isinstance(m, (nn.Embedding, WeightOnlyEmbedding)) else n
    return total


def gguf_bytes_per_token(path: str | os.PathLike) -> int:
    """`weight_bytes_per_token` of a GGUF file, from its tensor sizes: every tensor whole, ``token_embd`` one row,
    plus ``token_embd`` whole when the file has no ``output`` (llama.cpp then reads it as the head)."""
    from gguf import GGUFReader

    path = Path(path)
    reader = GGUFReader(path / FILE_NAME if path.is_dir() else path)
    tensors = {t.name: (int(t.n_bytes), int(t.shape[-1])) for t in reader.tensors}   # ggml shape: (row length, rows)
    del reader
    total = sum(n for name, (n, _) in tensors.items() if name != "token_embd.weight")
    embd, rows = tensors["token_embd.weight"]
    return total + embd // rows + (embd if "output.weight" not in tensors else 0)


def kv_bytes_per_token(config, context: float, element_bytes: int) -> float:
    """Bytes of keys and values one decode step reads at ``context`` cached positions (all layers, batch 1)."""
    from workbench.quantization.kvcache import bytes_per_position

    return bytes_per_position(config, None, element_bytes) * context


@dataclasses.dataclass(frozen=True)
class _Path:
    """One timed decoder: ``run(n)`` generates ``n`` tokens after the prompt."""

    label: str
    format: str
    runtime: str               # "PyTorch", "workbench" or "llama.cpp"
    kernel: str | None         # the workbench rows' WeightOnly(kernel=...)
    run: Callable[[int], list[int]] | None   # None: the format's file in llama.cpp (made per thread count)
    bytes_per_token: float     # weights + KV cache read per decode step


def _greedy_workbench(model, prompt: torch.Tensor, new_tokens: int, compile: bool = True) -> list[int]:
    from workbench.measurement.decode import greedy

    return greedy(model, prompt, new_tokens, compile=compile)[0, prompt.shape[1]:].tolist()


def _read_bandwidth_probe(x: torch.Tensor) -> float:
    return float(torch.sum(x))


def _vocabulary_folder(model: nn.Module, tmp: Path) -> Path | None:
    """None for a zoo model (the exporter has its tokenizer); else a folder with tiny-llama's tokenizer.json, which
    the exporter pads to the model's vocabulary with unused ids - timing feeds token ids, it never tokenizes text."""
    import shutil

    from workbench.models import llama, source_of
    from workbench.paths import data_dir

    if source_of(model) is not None:
        return None
    folder = tmp / "vocabulary"
    folder.mkdir()
    shutil.copy(data_dir() / llama.TOKENIZER_FILE, folder / "tokenizer.json")
    return folder


def decode_table(model: str | nn.Module = "tiny-llama", formats: Sequence[str] = ("f32", "q8_0", "q4_0"),
                 threads: Sequence[int] = (1, 2), new_tokens: int = 64, prompt_tokens: int = 32, rounds: int = 5,
                 folder: str | os.PathLike | None = None, workbench_kernels: Sequence[str] = ("auto",),
                 head: str | None = None, compile: bool = True):
    """Tokens per second of greedy batch-1 decoding of the same weights in llama.cpp (from the workbench's GGUF) and
    in the workbench, and fp32 in PyTorch as the baseline, beside the machine's read-bandwidth ceiling: for each
    thread count every path and the bandwidth probe run in interleaved rounds (`workbench.benchmarks.kernels_cpu.
    interleaved`; the untimed first call of each is its warm-up), median / min / max.

    ``model``: a zoo name (``"tiny-llama"``), a `BUILT_IN` name (``"llama-480m"``: TinyLlama-1.1B's shape with 8
    layers, random-init, seeded), or a Hugging Face Llama-style ``nn.Module``. ``formats``: ``f32`` = the
    unquantized model (the GGUF holds F32 tensors; its workbench row is the fp32 baseline), ``q8_0`` / ``q4_0`` =
    ``WeightOnly(bits=8 / 4, group_size=32, kernel=k)`` on every decoder layer's Linear (embedding and head stay
    fp32 in both runtimes), one workbench row per ``k`` in ``workbench_kernels`` (passed through as is), labelled
    ``"q4_0 workbench (auto)"``. ``head="q8_0"``: the quantized formats' ``lm_head`` in ``WeightOnly(bits=8,
    group_size=32, kernel=k)`` too (Q8_0 in the GGUF; llama.cpp's own quantized files keep the head above the
    layers' bits, Q6_K for Q4_0), for a model whose head is not tied to its embedding. ``compile``: whether the
    workbench's decode step is compiled (`workbench.measurement.decode`; False: its eager static-cache loop - for
    tests, not for figures).

    Columns: ``tokens_per_s`` = new tokens / the whole call (prompt included, as a user sees it);
    ``decode_tokens_per_s`` = ``(new_tokens - 1) / (median call - median prefill call)``, the prefill call (prompt
    + one token) timed in the same rounds; ``vs_fp32`` and ``vs_llama_cpp`` (workbench / llama.cpp, same format
    and threads) on ``tokens_per_s``; ``bandwidth_GBps`` = 1 GiB / the median time of ``torch.sum`` over a 1 GiB
    fp32 tensor at the same thread count; ``bytes_per_token`` = the weights one decode step reads
    (`weight_bytes_per_token` of the model, `gguf_bytes_per_token` of the file: every Linear's stored bytes incl.
    the head, an embedding one row, norms) + the KV cache read at the mean context ``prompt_tokens + (new_tokens -
    1) / 2`` (`kv_bytes_per_token`: fp32 in the workbench, fp16 in llama.cpp); ``percent_of_ceiling`` = 100 *
    ``bytes_per_token * decode_tokens_per_s / bandwidth``. Each row also says whether the two runtimes generated
    the same tokens (they need not: llama.cpp also quantizes the activations)."""
    import gc
    import tempfile

    import pandas as pd

    import workbench as wb
    from workbench.benchmarks.kernels_cpu import interleaved
    from workbench.measurement import num_threads
    from workbench.measurement.decode import vocab_size
    from workbench.models import source_of

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"formats {unknown} unknown; known: {sorted(FORMATS)}")
    for name, v, low in (("new_tokens", new_tokens, 2), ("prompt_tokens", prompt_tokens, 1), ("rounds", rounds, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if isinstance(model, nn.Module):
        base, label = model, source_of(model) or type(model).__name__
    elif model in BUILT_IN:
        base, label = built_in_model(model), model
    elif model in wb.models.names():
        base, label = wb.models.load(model), model
    else:
        raise ValueError(f"model {model!r} unknown: a zoo name ({wb.models.names()}), a built-in one "
                         f"({sorted(BUILT_IN)}) or an nn.Module")
    if not (hasattr(base, "model") and hasattr(base.model, "layers") and hasattr(base, "config")):
        raise TypeError(f"decode_table needs a Hugging Face Llama-style model (model.layers.*); {label!r} is a "
                        f"{type(base).__name__}")
    if head not in (None, "q8_0"):
        raise ValueError(f"head must be None (fp32) or 'q8_0', got {head!r}")
    if head is not None and getattr(base.config, "tie_word_embeddings", False):
        raise ValueError(f"head={head!r} needs a head of its own; {label!r} ties it to its embedding")
    bits = {f: b for f in formats if (b := FORMATS[f]) is not None}

    def plan(b: int, k: str) -> dict:
        entries = {"model.layers.*": wb.quant.WeightOnly(bits=b, group_size=GROUP, kernel=k)}
        if head is not None:
            entries["lm_head"] = wb.quant.WeightOnly(bits=8, group_size=GROUP, kernel=k)
        return entries

    smalls = {(f, k): wb.apply(base, plan(b, k), progress=False) for f, b in bits.items() for k in workbench_kernels}
    prompt = torch.randint(1, vocab_size(base), (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    context = prompt_tokens + new_tokens
    kv_ours, kv_theirs = (kv_bytes_per_token(base.config, prompt_tokens + (new_tokens - 1) / 2, b) for b in (4, 2))
    rows = []
    try:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            vocabulary = _vocabulary_folder(base, Path(tmp))
            exported = {f: wb.export(smalls[f, workbench_kernels[0]] if f in bits else base, Path(tmp) / f,
                                     format="gguf", base_folder=vocabulary) for f in formats}
            paths = [_Path(BASELINE, "f32", "PyTorch", None,
                           functools.partial(_greedy_workbench, base, prompt, compile=compile),
                           weight_bytes_per_token(base) + kv_ours)]
            for f in formats:
                paths += [_Path(f"{f} workbench ({k})", f, "workbench", k,
                                functools.partial(_greedy_workbench, smalls[f, k], prompt, compile=compile),
                                weight_bytes_per_token(smalls[f, k]) + kv_ours) for k in workbench_kernels
                          if f in bits]
                paths.append(_Path(f"{f} llama.cpp", f, "llama.cpp", None, None,
                                   gguf_bytes_per_token(exported[f]) + kv_theirs))
            for n in threads:
                rows += _time_paths(paths, exported, prompt, new_tokens, n, rounds, context, interleaved, num_threads)
    finally:
        smalls.clear()
        del base
        gc.collect()
    df = pd.DataFrame(rows)
    df.insert(0, "model", label)
    df["new_tokens"], df["prompt_tokens"], df["rounds"] = new_tokens, prompt_tokens, rounds
    fp32 = df[df["path"] == BASELINE].set_index("threads")["tokens_per_s"]
    df["vs_fp32"] = df["tokens_per_s"] / df["threads"].map(fp32)
    theirs = df[df["runtime"] == "llama.cpp"].set_index(["threads", "format"])["tokens_per_s"]
    keys = pd.MultiIndex.from_frame(df[["threads", "format"]])
    df["vs_llama_cpp"] = (df["tokens_per_s"].to_numpy() / theirs.reindex(keys).to_numpy())
    df.loc[df["runtime"] == "llama.cpp", "vs_llama_cpp"] = float("nan")
    return df


def _time_paths(paths: list[_Path], exported: dict[str, Path], prompt: torch.Tensor, new_tokens: int, n: int,
                rounds: int, context: int, interleaved, num_threads) -> list[dict]:
    """One thread count: every path (whole call and prefill call) and the bandwidth probe in interleaved rounds."""
    runtimes = {f: LlamaCpp(p, threads=n, context=context) for f, p in exported.items()}
    ids = prompt[0].tolist()
    probe = torch.ones(BANDWIDTH_BYTES // 4)                                   # (2**28,) fp32: 1 GiB
    try:
        runs = {p.label: p.run if p.run is not None else functools.partial(runtimes[p.format].greedy, ids)
                for p in paths}
        calls: dict = {}
        for label, run in runs.items():
            calls[label] = functools.partial(run, new_tokens)
            calls[label, "prefill"] = functools.partial(run, 1)
            if label == BASELINE:   # after PyTorch's calls, not llama.cpp's: its worker threads spin a while after a
                calls["bandwidth"] = functools.partial(_read_bandwidth_probe, probe)   # call, taking a core
        with num_threads(n), torch.inference_mode():
            first = {k: c() for k, c in calls.items()}                        # the warm-up, and the tokens compared
            times = interleaved(calls, rounds, warmup=0)
    finally:
        for r in runtimes.values():
            r.close()
        del probe
    gbps = BANDWIDTH_BYTES / (statistics.median(times["bandwidth"]) * 1e-3) / 1e9
    rows = []
    for p in paths:
        tps = [new_tokens / (v * 1e-3) for v in times[p.label]]
        decode_s = (statistics.median(times[p.label]) - statistics.median(times[p.label, "prefill"])) * 1e-3
        decode = (new_tokens - 1) / decode_s if decode_s > 0 else float("nan")
        other = (next((q.label for q in paths if q.format == p.format and q.runtime != "llama.cpp"), None)
                 if p.runtime == "llama.cpp" else f"{p.format} llama.cpp")
        rows.append({"threads": n, "path": p.label, "format": p.format, "runtime": p.runtime, "kernel": p.kernel,
                     "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps),
                     "tokens_per_s_max": max(tps), "decode_tokens_per_s": decode,
                     "same_tokens_as_other_runtime": first[p.label] == first[other] if other in first else None,
                     "bytes_per_token": p.bytes_per_token, "bandwidth_GBps": gbps,
                     "percent_of_ceiling": 100 * p.bytes_per_token * decode / (gbps * 1e9)})
    return rows


def main(argv=None) -> None:
    import importlib.metadata

    from workbench.benchmarks.kernels import environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama", help=f"a zoo name or {' / '.join(BUILT_IN)}")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--kernels", nargs="+", default=["auto"], help="the workbench rows' WeightOnly(kernel=...)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--head", choices=["q8_0"], default=None,
                   help="the quantized formats' head in int8 g32 too (Q8_0; an untied head only)")
    a = p.parse_args(argv)
    print(environment())
    print(f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')}")
    df = decode_table(a.model, formats=a.formats, threads=a.threads, new_tokens=a.new_tokens,
                      prompt_tokens=a.prompt_tokens, rounds=a.rounds, workbench_kernels=a.kernels, head=a.head)
    print(f"{df['model'][0]}: greedy batch 1, {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens, "
          f"median of {a.rounds} interleaved rounds; read ceiling = torch.sum over 1 GiB fp32")
    df["MB_per_token"] = df["bytes_per_token"] / 1e6
    cols = ["threads", "path", "tokens_per_s", "decode_tokens_per_s", "vs_llama_cpp", "vs_fp32", "MB_per_token",
            "bandwidth_GBps", "percent_of_ceiling", "same_tokens_as_other_runtime"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))


if __name__ == "__main__":
    main()
