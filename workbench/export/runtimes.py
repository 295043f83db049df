"""Exported models in the runtime they will be deployed with, as `nn.Module`s the workbench's measurements take.

`OnnxRuntimeModel` runs a ``wb.export(format=ONNX(...))`` file in ONNX Runtime (CPUExecutionProvider), and
`LlamaCppModel` a ``wb.export(format="gguf")`` file in llama.cpp (`workbench.export.llama_cpp.LlamaCpp`). Both hold no
PyTorch tensors: `wb.measure` scores them on a task, `wb.speedup` times them against the workbench's own model in
paired rounds, and their size is the exported file's bytes on disk (`workbench.measurement.footprint.FileModel`),
so a trade-off chart can use the latency of the runtime the model ships in. Comparing the fp32 model, the workbench's
compressed model and its export in ONNX Runtime:

    task = wb.tasks.load("digits")
    model = wb.models.load("digits-mlp")
    small = wb.apply(model, {"fc*": wb.quant.WeightOnly(bits=4, group_size=32)})
    folder = wb.export(small, "mlp-int4", format=ONNX(example_inputs=task.example_inputs(1), input_names=("x",),
                                                       dynamic_axes={"x": {0: "batch"}}))
    wb.compare(wb.measure(model, task), wb.measure(small, task, baseline=model),
               wb.measure(OnnxRuntimeModel(folder), task, baseline=model),
               labels=["fp32 (PyTorch)", "int4 (workbench)", "int4 (ONNX Runtime)"])

and a causal LM with its generation speed (``tokens_per_s``) in llama.cpp beside the workbench's kernels:

    llm = wb.models.load("tiny-llama")
    q4 = wb.apply(llm, {"model.layers.*": wb.quant.WeightOnly(bits=4, group_size=32)})
    runtime = LlamaCppModel(wb.export(q4, "tiny-llama-q4", format="gguf"), config=llm.config)
    wb.compare(wb.measure(q4, "tiny-llama", generate_tokens=32),
               wb.measure(runtime, "tiny-llama", baseline=q4, generate_tokens=32))

What each measurement reads from them:

| measurement | `OnnxRuntimeModel` | `LlamaCppModel` |
|---|---|---|
| quality (the task's forward) | ``session.run`` on the inputs as numpy | llama.cpp's logits, one sequence at a time |
| latency, `wb.speedup` | one ``session.run`` | one forward: a fresh KV cache per sequence, all logits |
| ``tokens_per_s`` | - (not a causal LM) | `generate`: greedy; prompt in one batch, 1 token a step |
| ``size_bytes`` | ``model.onnx``'s bytes | ``model.gguf``'s bytes |
| ``peak_memory_bytes`` | the file + PyTorch's allocations, not the runtime's own (the method says so) | same |
| ``kernels`` | ``{"OnnxRuntimeModel:onnxruntime": 1}`` | ``{"LlamaCppModel:llama.cpp": 1}`` |

Threads follow the workbench's setting: with ``threads=None`` each call uses ``torch.get_num_threads()`` at call time
(what ``wb.measure(threads=n)`` / ``wb.speedup(threads=n)`` set), ONNX Runtime by building its session again with
``intra_op_num_threads`` when the count changed (the count is fixed per session), llama.cpp by
``llama_set_n_threads`` (no reload). An int fixes the count.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from workbench.export.onnx import FILE_NAME as ONNX_FILE
from workbench.measurement.footprint import FileModel

if TYPE_CHECKING:   # (imported where used: `python -m workbench.export.llama_cpp` runs that module as __main__, and
    # runpy warns when the package's import has already loaded it)
    from workbench.export.llama_cpp import LlamaCpp

__all__ = ["OnnxRuntimeModel", "LlamaCppModel", "gguf_config", "runtime_model"]

# ONNX Runtime's input type -> the numpy dtype it takes (other types are left to ONNX Runtime to check)
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def _threads(threads: int | None) -> int | None:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be a positive int or None (follow torch.get_num_threads()), got {threads!r}")
    return threads


def _cpu_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: the runtime reads CPU memory; got a tensor on {t.device} (move it with .cpu())")
    return t


# --- ONNX Runtime ----------------------------------------------------------------------------------------------------

class OnnxRuntimeModel(FileModel):
    """An exported ONNX file (a folder from ``wb.export(format=ONNX(...))`` or a ``.onnx`` path) run by ONNX Runtime
    on the CPU (CPUExecutionProvider, default graph optimizations, sequential execution).

    ``forward(*inputs, **named)``: CPU tensors, positional ones matched to the graph's inputs in order, keyword ones by
    input name; returns the graph's output as a tensor, or a tuple of tensors when it has several. ``threads``: ONNX
    Runtime's intra-op threads; None (default) follows ``torch.get_num_threads()`` at each call. ``spinning``: let
    idle pool threads spin for the next call (ONNX Runtime's default); off here, since a spinning pool takes the cores
    from the model it is timed against in `wb.speedup`'s alternating rounds.
    """

    file_format: ClassVar[str] = "onnx"
    kernel: ClassVar[str] = "onnxruntime"

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, spinning: bool = False):
        super().__init__()
        path = Path(path)
        if path.is_dir():
            path = path / ONNX_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX file at {path} (wb.export(..., format=ONNX(...)) writes {ONNX_FILE} "
                                    f"into the folder it creates)")
        self.path, self.threads, self.spinning = path, _threads(threads), bool(spinning)
        self._session: Any = None
        self.session_threads = 0   # the intra-op thread count of the current session (0: none built yet)
        session = self.session
        self.input_specs = tuple((i.name, i.type) for i in session.get_inputs())
        self.output_names = tuple(o.name for o in session.get_outputs())

    @property
    def session(self):
        """The ``onnxruntime.InferenceSession`` for the current thread count (built again when that changed)."""
        n = self.threads or torch.get_num_threads()
        if n != self.session_threads:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = n
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
            self._session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
            self.session_threads = n
        return self._session

    def _feeds(self, inputs: tuple, named: dict[str, Any]) -> dict[str, np.ndarray]:
        names = [name for name, _ in self.input_specs]
        unknown = sorted(set(named) - set(names))
        given = names[:len(inputs)] + [n for n in names[len(inputs):] if n in named]
        if unknown or len(inputs) > len(names) or len(given) != len(names) or set(names[:len(inputs)]) & set(named):
            raise TypeError(f"{self.path} takes {len(names)} input(s) {names}, got {len(inputs)} positional and "
                            f"keyword {sorted(named)}")
        feeds = {}
        for (name, kind), t in zip(self.input_specs, [*inputs, *(named[n] for n in given[len(inputs):])]):
            t = _cpu_tensor(t, f"input {name!r} of {self.path}")
            a = np.ascontiguousarray(t.detach().numpy())
            wanted = ORT_DTYPES.get(kind)
            if wanted is not None and a.dtype != wanted:
                raise TypeError(f"input {name!r} of {self.path} is {kind}, got a {t.dtype} tensor")
            feeds[name] = a
        return feeds

    def forward(self, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        feeds = self._feeds(inputs, named)
        outs = tuple(torch.from_numpy(o) for o in self.session.run(None, feeds))
        return outs[0] if len(outs) == 1 else outs

    def extra_repr(self) -> str:
        return f"{self.path}, threads={self.threads or 'torch'}"


# --- llama.cpp -------------------------------------------------------------------------------------------------------

def gguf_config(runtime: LlamaCpp):
    """A Hugging Face ``PretrainedConfig`` from the GGUF file's metadata, for a `LlamaCppModel` given no config: its
    vocabulary, context length, bos / eos / padding ids and architecture (``gguf_architecture``)."""
    import transformers

    meta = runtime.metadata

    def token(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return transformers.PretrainedConfig(vocab_size=runtime.vocab, max_position_embeddings=runtime.context,
                                         bos_token_id=token("bos_token_id"), eos_token_id=token("eos_token_id"),
                                         pad_token_id=token("padding_token_id"),
                                         gguf_architecture=meta.get("general.architecture"))


class LlamaCppModel(FileModel):
    """A GGUF file (or a folder from ``wb.export(format="gguf")``) run by llama.cpp, as a causal LM.

    ``forward(input_ids)``: (B, T) token ids -> an output whose ``logits`` are (B, T, vocab) float32, llama.cpp's
    logits for every position, one sequence at a time (each from a fresh KV cache). `generate`: greedy decoding
    through llama.cpp's KV cache, returning ids as Hugging Face's ``generate`` does. ``config``: the config of the
    model the file was exported from (e.g. ``model.config``; ``vocab_size`` must be the file's); None builds one from
    the file's metadata (`gguf_config`). ``threads``: None follows ``torch.get_num_threads()`` at each call.
    ``context``, ``kv_type``, ``flash_attention``: as `LlamaCpp` takes them (the KV cache is fp16 by default, as
    llama.cpp deploys it).
    """

    file_format: ClassVar[str] = "gguf"
    kernel: ClassVar[str] = "llama.cpp"

    def __init__(self, path: str | os.PathLike, *, config: Any = None, threads: int | None = None,
                 context: int | None = None, kv_type: str = "f16", flash_attention: bool = False):
        super().__init__()
        self.threads = _threads(threads)
        from workbench.export.llama_cpp import LlamaCpp

        self.runtime = LlamaCpp(path, threads=threads, context=context, kv_type=kv_type,
                                flash_attention=flash_attention)
        self.path = self.runtime.path
        self.config = gguf_config(self.runtime) if config is None else config
        vocab = getattr(self.config, "vocab_size", None)
        if vocab != self.runtime.vocab:
            self.runtime.close()
            raise ValueError(f"config.vocab_size is {vocab}, the file {self.path} has a vocabulary of "
                             f"{self.runtime.vocab}: pass the config of the model it was exported from")

    def close(self) -> None:
        self.runtime.close()

    def _run(self) -> LlamaCpp:
        self.runtime.threads = self.threads or torch.get_num_threads()
        return self.runtime

    def _ids(self, input_ids: Any, attention_mask: Any) -> list[list[int]]:
        ids = _cpu_tensor(input_ids, "input_ids")
        if ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be (batch, tokens) integer ids, got {ids.dtype} {tuple(ids.shape)}")
        if attention_mask is not None and not bool((torch.as_tensor(attention_mask) == 1).all()):
            raise ValueError("llama.cpp runs each sequence whole: an attention_mask with padded (0) positions is not "
                             "supported")
        return ids.tolist()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from transformers.modeling_outputs import CausalLMOutput

        runtime = self._run()
        logits = torch.stack([runtime.logits(row) for row in self._ids(input_ids, attention_mask)])   # (B, T, V)
        return CausalLMOutput(logits=logits)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int | None = None, min_new_tokens: int | None = None,
                 do_sample: bool = False, *, attention_mask: torch.Tensor | None = None, use_cache: bool = True,
                 pad_token_id: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                 num_beams: int = 1, **unsupported) -> torch.Tensor:
        """Greedy decoding as Hugging Face's ``generate`` does it: ``input_ids`` (B, T) followed by up to
        ``max_new_tokens`` argmax tokens, (B, T + new) int64. A sequence ends at an end-of-text token
        (``eos_token_id``, default the config's) once ``min_new_tokens`` are out (the token is masked before); the
        others go on, and finished ones are padded with ``pad_token_id``. Each sequence runs on its own: the prompt
        in one batch, then one token per step through llama.cpp's KV cache.

        Refused: ``do_sample=True``, ``num_beams > 1``, ``use_cache=False`` (llama.cpp always decodes with its cache),
        padded attention masks and every other generation argument."""
        if unsupported:
            raise TypeError(f"LlamaCppModel.generate does not support {sorted(unsupported)}: it decodes greedily "
                            f"(max_new_tokens, min_new_tokens, eos_token_id, pad_token_id, attention_mask of ones)")
        if do_sample:
            raise ValueError("LlamaCppModel.generate decodes greedily (argmax) only: do_sample=True (sampling) is not "
                             "supported")
        if num_beams != 1:
            raise ValueError(f"LlamaCppModel.generate decodes greedily: num_beams={num_beams} (beam search) is not "
                             f"supported")
        if not use_cache:
            raise ValueError("llama.cpp always decodes through its KV cache: use_cache=False is not supported")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        eos = getattr(self.config, "eos_token_id", None) if eos_token_id is None else eos_token_id
        stops = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
        pad = pad_token_id if pad_token_id is not None else getattr(self.config, "pad_token_id", None)
        pad = int(pad if pad is not None else stops[0] if stops else 0)
        runtime = self._run()
        rows = [row + runtime.greedy(row, max_new_tokens, stop_tokens=stops, min_new_tokens=min_new_tokens or 0)
                for row in self._ids(input_ids, attention_mask)]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)   # (B, T + new)

    def extra_repr(self) -> str:
        return f"{self.path}, threads={self.threads or 'torch'}"


# --- by format -------------------------------------------------------------------------------------------------------

def runtime_model(folder: str | os.PathLike, format: str, *, config: Any = None):
    """The exported ``folder`` (written by ``wb.export(..., format=format)``) as the runtime that deploys it runs it,
    as an `nn.Module` for `wb.measure` / `wb.speedup`: ``"onnx"`` -> `OnnxRuntimeModel`, ``"gguf"`` ->
    `LlamaCppModel` (``config``: the exported model's config), ``"compressed-tensors"`` -> transformers'
    ``from_pretrained`` of the folder (compressed-tensors' own loader: the model a transformers user gets, its
    Linears decompressed on load; vLLM's kernels are not run here)."""
    from workbench.export import ExportFormat

    name = format.name if isinstance(format, ExportFormat) else format
    folder = Path(folder)
    if name == "onnx":
        return OnnxRuntimeModel(folder)
    if name == "gguf":
        return LlamaCppModel(folder, config=config)
    if name == "compressed-tensors":
        import json

        import transformers

        from workbench.models.checkpoint import auto_class_name

        archs = json.loads((folder / "config.json").read_text()).get("architectures") or [None]
        auto = getattr(transformers, auto_class_name(archs[0]))
        return auto.from_pretrained(str(folder), local_files_only=True, use_safetensors=True).eval()
    raise ValueError(f"runtime_model: unknown export format {name!r} (onnx, gguf or compressed-tensors)")
