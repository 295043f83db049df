"""The generated technique forms, config labels in words and the layer grid, without a model."""
import pandas as pd
import pytest
import torch

import workbench as wb
from workbench.plans.registry import registered_configs
from workbench.ui.forms import TechniqueForm, describe, technique_forms
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
