"""The generated technique forms, config labels in words and the layer grid, without a model."""
import dataclasses

import ipywidgets as W
import pandas as pd
import pytest
import torch
import traitlets

import workbench as wb
from workbench.plans.registry import Config, config_from_dict, config_to_dict, registered_configs
from workbench.pruning.configs import STORAGES, UNSTRUCTURED_STORAGES
from workbench.quantization.configs import STATIC_KERNELS, W8A8_KERNELS
from workbench.quantization.modules import KERNELS
from workbench.quantization.observers import OBSERVERS
from workbench.ui.forms import NONE, TechniqueForm, describe, field_choices, field_docs, technique_forms
from workbench.ui.layer_table import LayerTable


@pytest.mark.parametrize(("config", "words"), [
    (wb.quant.WeightOnly(bits=4, group_size=32), "WeightOnly · 4 bits · group 32 · rtn"),
    (wb.quant.WeightOnly(bits=8, group_size=None, method="gptq"), "WeightOnly · 8 bits · per channel · gptq"),
    (wb.prune.Magnitude(0.7), "Magnitude · 70% sparse"),
    (wb.prune.NM(), "NM · n 2 · m 4"),
    (wb.lowrank.SVD(rank=5), "SVD · rank 5"),
    (wb.precision.Cast(torch.float16), "Cast · float16"),
    (None, "none"),
])
def test_describe_in_words(config, words):
    assert describe(config) == words


def test_every_registered_config_gets_a_form_that_round_trips():
    forms = technique_forms()
    assert list(forms) == registered_configs()
    for cls, form in forms.items():
        assert form.label.startswith(cls.__name__) and form.help
    for config in (wb.quant.WeightOnly(bits=2, group_size=None, method="hqq", symmetric=False),
                   wb.quant.FP8(dtype=torch.float8_e5m2), wb.quant.Static(observer="percentile"),
                   wb.lowrank.SVD(energy=0.8), wb.prune.Random(0.3, seed=4)):
        form = forms[type(config)]
        form.show(config)
        assert form.config() == config
    with pytest.raises(TypeError, match="edits NF4, not FP8"):
        forms[wb.quant.NF4].show(wb.quant.FP8())
    with pytest.raises(TypeError, match="not a registered config"):
        TechniqueForm(int)


# every registered config: its defaults where they make a config, and configs with other values (choices included)
EXAMPLES = {
    wb.lowrank.SVD: [wb.lowrank.SVD(rank=5), wb.lowrank.SVD(energy=0.8)],
    wb.quant.WeightOnly: [wb.quant.WeightOnly(), wb.quant.WeightOnly(bits=8, kernel="cpu"),
                          wb.quant.WeightOnly(bits=2, group_size=None, method="hqq", symmetric=False),
                          wb.quant.WeightOnly(method="gptq", act_order=True, static_groups=True, damp=0.05,
                                              kernel="triton")],
    wb.quant.NF4: [wb.quant.NF4(), wb.quant.NF4(group_size=None)],
    wb.quant.FP8: [wb.quant.FP8(), wb.quant.FP8(dtype=torch.float8_e5m2)],
    wb.quant.MXFP4: [wb.quant.MXFP4()], wb.quant.MXFP8: [wb.quant.MXFP8()], wb.quant.NVFP4: [wb.quant.NVFP4()],
    wb.quant.Dynamic: [wb.quant.Dynamic(), wb.quant.Dynamic(kernel="triton", smooth_alpha=0.5)],
    wb.quant.Static: [wb.quant.Static(), wb.quant.Static(observer="percentile", kernel="cpu")],
    wb.precision.Cast: [wb.precision.Cast(), wb.precision.Cast(torch.float16)],
    wb.prune.Magnitude: [wb.prune.Magnitude(), wb.prune.Magnitude(0.7, storage="csr")],
    wb.prune.Random: [wb.prune.Random(), wb.prune.Random(0.3, seed=4, storage="dense")],
    wb.prune.NM: [wb.prune.NM(), wb.prune.NM(1, 4, storage="csr"), wb.prune.NM(storage="2:4")],
    wb.prune.Wanda: [wb.prune.Wanda(), wb.prune.Wanda(nm=(2, 4), storage="2:4")],
    wb.prune.SparseGPT: [wb.prune.SparseGPT(), wb.prune.SparseGPT(0.6, damp=0.1, block_size=64, storage="dense")],
    wb.prune.KeptExperts: [wb.prune.KeptExperts(), wb.prune.KeptExperts(intermediate=8, experts=2)],
    wb.prune.KeptRouter: [wb.prune.KeptRouter(), wb.prune.KeptRouter(3)],
    wb.prune.Kept: [wb.prune.Kept(), wb.prune.Kept(out_channels=4)],
    wb.prune.KeptHeads: [wb.prune.KeptHeads(), wb.prune.KeptHeads(2)],
}


def workbench_configs() -> list[type]:
    """The registered config classes of the package (other tests register their own)."""
    return [cls for cls in registered_configs() if cls.__module__.startswith("workbench.")]


def test_every_registered_config_round_trips_through_its_form_exactly():
    assert set(EXAMPLES) == set(workbench_configs())
    forms = technique_forms()
    for cls, configs in EXAMPLES.items():
        form = forms[cls]
        for config in configs:
            form.show(config)
            back = form.config()
            assert back == config and type(back) is cls, (config, back)
            assert config_from_dict(config_to_dict(back)) == config   # the saved form is unchanged too
        if cls is not wb.lowrank.SVD:   # (SVD has no default: rank or energy must be given)
            assert TechniqueForm(cls).config() == cls()   # a fresh form starts at the class's defaults


# the values each config's storage / kernel accepts (checked against the words too: a changed constant is seen)
STORAGE = {wb.prune.Magnitude: UNSTRUCTURED_STORAGES, wb.prune.Random: UNSTRUCTURED_STORAGES,
           wb.prune.NM: STORAGES, wb.prune.Wanda: STORAGES, wb.prune.SparseGPT: STORAGES}
KERNEL = {wb.quant.WeightOnly: KERNELS, wb.quant.Dynamic: W8A8_KERNELS, wb.quant.Static: STATIC_KERNELS}
# what a choice needs of the other fields (each config refuses it otherwise, saying why)
NEEDS = {(wb.prune.Wanda, "2:4"): {"nm": "2, 4"}, (wb.prune.SparseGPT, "2:4"): {"nm": "2:4"},
         (wb.quant.WeightOnly, wb.quant.Method.HQQ): {"symmetric": False}}


def test_storage_and_kernel_are_dropdowns_of_exactly_the_allowed_values():
    assert set(STORAGES) == {"mask", "dense", "csr", "2:4"} and set(UNSTRUCTURED_STORAGES) == {"mask", "dense", "csr"}
    assert set(KERNELS) == {"auto", "reference", "cpu", "cpu-int8", "triton"}
    assert set(W8A8_KERNELS) == {"auto", "reference", "cpu", "triton"}
    assert set(STATIC_KERNELS) == {"auto", "reference", "cpu"}
    forms = technique_forms()
    for field, table in (("storage", STORAGE), ("kernel", KERNEL)):
        for cls, allowed in table.items():
            w = forms[cls][field]
            assert isinstance(w, W.Dropdown), (cls, field)
            assert list(w.options) == [(v, v) for v in allowed], (cls, field, w.options)
            assert w.description == field and w.tooltip, (cls, field)   # labelled, and what the class says of it
            assert field_choices({f.name: f for f in dataclasses.fields(cls)}[field]) == tuple(allowed)
    assert [v for _, v in forms[wb.quant.Static]["observer"].options] == list(OBSERVERS)
    assert [v for _, v in forms[wb.precision.Cast]["dtype"].options] == ["float16", "bfloat16", "float32"]
    assert [v for _, v in forms[wb.quant.FP8]["dtype"].options] == ["float8_e4m3fn", "float8_e5m2"]
    assert [v for _, v in forms[wb.quant.WeightOnly]["method"].options] == list(wb.quant.Method)


def test_picking_each_choice_builds_a_config_that_validates():
    picked = 0
    for cls in workbench_configs():
        for name, w in TechniqueForm(cls).widgets.items():
            if not isinstance(w, W.Dropdown):
                continue
            for _, value in w.options:
                form = TechniqueForm(cls)
                for other, text in NEEDS.get((cls, value), {}).items():
                    form[other].value = text
                form[name].value = value
                config = form.config()   # validates (the config's __post_init__)
                got = getattr(config, name)
                assert got == value or str(got).removeprefix("torch.") == value, (cls, name, value, got)
                form.show(config)
                assert form[name].value == value and form.config() == config
                picked += 1
    # WeightOnly method 4 + kernel 5, FP8 2, Dynamic 4, Static 5 + 3, Cast 3, Magnitude 3, Random 3, NM, Wanda,
    # SparseGPT 4 each
    assert picked == 44


def test_a_value_outside_the_choices_cannot_be_entered():
    form = TechniqueForm(wb.prune.Magnitude)
    for bad in ("2:4", "sparse", ""):
        with pytest.raises(traitlets.TraitError):
            form["storage"].value = bad
    assert form["storage"].value == "mask" and form.config() == wb.prune.Magnitude()
    static = TechniqueForm(wb.quant.Static)
    for bad in ("triton", "cpu-int8"):
        with pytest.raises(traitlets.TraitError):
            static["kernel"].value = bad
    with pytest.raises(traitlets.TraitError):
        static["observer"].value = "max"
    with pytest.raises(ValueError, match="Dynamic.kernel must be one of"):   # what the dropdown leaves out
        wb.quant.Dynamic(kernel="cpu-int8")
    with pytest.raises(ValueError, match="Static W8A8 has 'reference' and 'cpu' kernels"):
        wb.quant.Static(kernel="triton")


@dataclasses.dataclass(frozen=True)
class Choosy(Config):
    """A config with an optional choice (not registered)."""

    mode: str | None = dataclasses.field(default=None, metadata={"choices": ("fast", "exact")})  # how to run it
    dtype: torch.dtype = dataclasses.field(default=torch.float16, metadata={"choices": (torch.float16, torch.bfloat16)})
    keep_going: bool = False   # go on after an error
    #                            (a continuation line)


def test_optional_choices_get_a_none_entry_and_controls_are_labelled():
    form = TechniqueForm(Choosy)
    mode = form["mode"]
    assert [label for label, _ in mode.options] == ["fast", "exact", "none"] and mode.value is NONE
    assert form.config() == Choosy() and mode.tooltip == "how to run it"
    mode.value = "exact"
    form["dtype"].value = "bfloat16"
    assert form.config() == Choosy(mode="exact", dtype=torch.bfloat16)
    form.show(Choosy())
    assert mode.value is NONE and form["dtype"].value == "float16" and form.config() == Choosy()
    box = form["keep_going"]
    assert isinstance(box, W.Checkbox) and box.description == "keep going"
    assert box.tooltip == "go on after an error (a continuation line)"
    for cls, f in technique_forms().items():   # every control is labelled with its field's name in words
        assert {n: w.description for n, w in f.widgets.items()} == {n: n.replace("_", " ") for n in f.widgets}


def test_field_docs_come_from_the_field_comments_and_the_docstring():
    docs = field_docs(wb.quant.WeightOnly)
    assert docs["static_groups"].startswith("GPTQ act_order: groups of the original columns (True) or, as the ")
    assert docs["static_groups"].endswith("(False: the layer stores a column permutation)")
    assert "bits" not in docs   # said only in prose: no tooltip rather than a wrong one
    assert field_docs(wb.quant.Dynamic)["smooth_alpha"] == \
        "SmoothQuant migration strength (needs calibration), None for plain W8A8"
    assert field_docs(wb.prune.KeptExperts) == {"intermediate": "the channels each expert keeps",
                                                "experts": "how many experts remain"}


def test_layer_table_selection_by_name():
    rows = pd.DataFrame({"layer": ["a", "b", "c"], "type": "Linear", "shape": "2×2", "params": [6, 6, 6],
                         "technique": "none", "bytes_before": [24, 24, 24], "bytes_after": [24, 24, 24],
                         "state": "", "loss": [float("nan"), 0.25, float("nan")]})
    table = LayerTable(rows)
    table.value = ("c", "a")
    assert table.widget.selected_rows == [0, 2] and table.value == ("a", "c")
    table.update(rows.assign(technique=["x", "y", "z"]))
    assert table.value == ("a", "c") and '"+0.2500"' in table.widget._dt_args["data_json"]
    with pytest.raises(ValueError, match="not layers of this table: 'zz'"):
        table.value = ("zz",)
    with pytest.raises(ValueError, match="layers changed"):
        table.update(rows.iloc[:2])
