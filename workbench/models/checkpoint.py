"""Local Hugging Face checkpoints: ``wb.models.load("path/to/folder")``, offline and without unpickling.

The folder must hold ``config.json`` and ``*.safetensors`` weights (what ``save_pretrained`` writes). The
Auto class comes from the config's ``architectures`` (e.g. ``BertForSequenceClassification`` ->
``AutoModelForSequenceClassification``); a config without one loads as the bare ``AutoModel``. Nothing is
downloaded (``local_files_only``), and a folder holding only a pickle checkpoint (``pytorch_model.bin``, ``.pt``,
``.pth``, ``.ckpt``) is refused, since unpickling can run arbitrary code. A checkpoint whose config has a
compressed-tensors ``quantization_config`` (llm-compressor's format, or ``wb.export``'s) loads with its quantized
layers as the workbench's own modules holding the checkpoint's codes and scales
(`workbench.models.compressed_tensors_checkpoint`).
"""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

__all__ = ["load_checkpoint", "auto_class_name", "PICKLE_SUFFIXES"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# The architecture's suffix -> the Auto class with that head. Longest suffix first, so
# "ForSequenceClassification" is not read as "...Classification".
_HEADS = (
    ("ForSequenceClassification", "AutoModelForSequenceClassification"),
    ("ForTokenClassification", "AutoModelForTokenClassification"),
    ("ForImageClassification", "AutoModelForImageClassification"),
    ("ForQuestionAnswering", "AutoModelForQuestionAnswering"),
    ("ForMultipleChoice", "AutoModelForMultipleChoice"),
    ("ForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    ("ForCausalLM", "AutoModelForCausalLM"),
    ("LMHeadModel", "AutoModelForCausalLM"),
    ("ForMaskedLM", "AutoModelForMaskedLM"),
    ("Model", "AutoModel"),
)


def auto_class_name(architecture: str | None) -> str:
    """The transformers Auto class for an ``architectures`` entry (``AutoModel`` when there is none)."""
    if not architecture:
        return "AutoModel"
    for suffix, auto in _HEADS:
        if architecture.endswith(suffix):
            return auto
    raise ValueError(f"architecture {architecture!r} has no known Auto class; load it with transformers directly")


def load_checkpoint(path: str | Path) -> nn.Module:
    """The model saved in the folder ``path`` (see the module docstring), fp32 weights as saved, in eval mode; a
    compressed-tensors checkpoint's quantized layers as workbench modules (recorded as an applied plan)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder (expected a Hugging Face checkpoint: config.json + "
                                f"*.safetensors)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder "
                                f"(save_pretrained)?")
    if not list(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(f"{folder} holds a pickle checkpoint ({', '.join(pickles)}), which is not loaded: "
                             f"unpickling can run arbitrary code. Convert it to safetensors where you trust it "
                             f"(model.save_pretrained(folder, safe_serialization=True))")
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    archs = config.get("architectures") or [None]
    import transformers

    auto = getattr(transformers, auto_class_name(archs[0]))
    from workbench.models.compressed_tensors_checkpoint import is_compressed_tensors, load_compressed_tensors

    if is_compressed_tensors(config):
        return load_compressed_tensors(folder, auto)
    model = auto.from_pretrained(str(folder), local_files_only=True, use_safetensors=True)
    return model.eval()
