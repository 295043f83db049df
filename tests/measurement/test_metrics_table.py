"""`wb.compare` returns a `MetricsTable`: its values are the numbers measured, its notebook display formats them
by field (bytes in KiB / MiB, ms, speedups as x, 4 significant figures), as columns or transposed; and it gives
the reference's latency from the same paired rounds as each paired row's."""
import math

import pandas as pd
import pytest

import workbench as wb
from workbench.measurement.table import MetricsTable, format_value, styled


@pytest.mark.parametrize("field, value, text", [
    ("size_bytes", 90269696, "86.09 MiB"), ("peak_memory_bytes", 1.48926e7, "14.20 MiB"), ("size_bytes", 512, "512 B"),
    ("latency_ms", 2043.967643, "2,044 ms"), ("latency_p90_ms", 0.073799, "0.07380 ms"), ("speedup", 0.97265, "0.973x"),
    ("size_ratio", 0.25969, "0.260x"), ("accuracy", 0.972656, "0.9727"), ("batch_size", 64, "64"),
    ("speedup_verdict", "baseline", "baseline"), ("same_rounds_reference_ms", math.nan, "-"), ("ok", True, "True")])
def test_values_are_formatted_by_their_field(field, value, text):
    assert format_value(field, value) == text


def test_compare_is_a_formatted_table_of_unchanged_numbers_in_one_regime(digits_mlp, digits_task):
    reference = wb.measure(digits_mlp, digits_task, quick=True, threads=1)
    small = wb.apply(digits_mlp, {"fc*": wb.quant.WeightOnly(bits=8)}, progress=False)
    result = wb.measure(small, digits_task, quick=True, threads=1, baseline=digits_mlp)
    df = wb.compare(reference, result, labels=["reference", "int8"])
    assert isinstance(df, MetricsTable) and isinstance(df.T, MetricsTable)
    assert df.loc["int8", "size_bytes"] == result.size_bytes                 # numbers stay numbers
    assert df.loc["int8", "same_rounds_reference_ms"] == pytest.approx(result.speedup.baseline_ms)
    assert pd.isna(df.loc["reference", "same_rounds_reference_ms"])
    for table in (df, df.T):   # fields as columns, or as rows (one column per model)
        html = table._repr_html_()
        assert "KiB</td>" in html and " ms</td>" in html and "x</td>" in html
        assert str(result.size_bytes) not in html                            # no raw byte counts on screen
    # many fields of two models: shown one column per model, whichever way the table is held
    header = df._repr_html_().split("</thead>")[0]
    assert ">reference</th>" in header and ">int8</th>" in header and ">latency_ms</th>" not in header
    shown = styled(df.T).data
    assert shown.loc["size_bytes", "int8"] == format_value("size_bytes", result.size_bytes)
