"""`wb.sweep` measures plans that give the same model once: a report's plan that equals one of the uniform plans
beside it is one row (the first label) with the other label in ``same_as``, never two rows whose latencies, taken
in different rounds, put one copy off the front."""
import workbench as wb

INT8 = wb.quant.WeightOnly(bits=8)


def test_the_same_plan_under_two_labels_is_one_row(digits_mlp, digits_task):
    plans = {"plan": wb.Plan({"fc*": INT8}),                   # a glob ...
             "int8": wb.Plan({"fc1": INT8, "fc2": INT8, "fc3": INT8}),   # ... and the same layers by name
             "int4 fc1": wb.Plan({"fc1": wb.quant.WeightOnly(bits=4, group_size=32)})}
    df = wb.sweep(digits_mlp, digits_task, plans, quick=True, threads=1, progress=False)
    assert list(df["label"]) == ["reference", "plan", "int4 fc1"]
    assert list(df["same_as"]) == ["", "int8", ""]
    assert df["pareto_size"].tolist() == wb.pareto(df, "size_bytes", "accuracy").tolist()
