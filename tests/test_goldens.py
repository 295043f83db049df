"""Golden-metric comparison: directions, tolerances, messages naming notebook / metric / expected / found,
deliberate updates, and the `workbench goldens` command failing on a regression."""
import json

import pytest

from workbench import goldens
from workbench.cli import main
from workbench.goldens import Golden, GoldenMetric


def golden(*metrics):
    return Golden("10_number_formats", [GoldenMetric(*m) for m in metrics])


@pytest.mark.parametrize("direction, found, ok", [
    ("higher", 0.90, True), ("higher", 0.895, True), ("higher", 0.889, False), ("higher", 0.99, True),
    ("lower", 0.10, True), ("lower", 0.105, True), ("lower", 0.111, False), ("lower", 0.0, True),
    ("equal", 0.5, True), ("equal", 0.509, True), ("equal", 0.491, True), ("equal", 0.52, False),
])
def test_directions_and_tolerances(direction, found, ok):
    value = {"higher": 0.90, "lower": 0.10, "equal": 0.5}[direction]
    g = golden(("m", value, 0.01, direction))
    assert (goldens.compare(g, {"m": found}) == []) is ok


def test_message_names_notebook_metric_expected_and_found():
    g = golden(("accuracy", 0.97, 0.01, "higher"), ("exercises_passed", 3, 0, "equal"))
    failures = goldens.compare(g, {"accuracy": 0.90, "exercises_passed": 3})
    assert len(failures) == 1
    msg = failures[0]
    assert "10_number_formats" in msg and "'accuracy'" in msg and "0.97" in msg and "0.9" in msg
    assert "higher" in msg and "dropped by 0.07" in msg


def test_missing_nonfinite_and_nonnumeric_values_fail():
    g = golden(("a", 1.0, 0.1, "higher"), ("b", 1.0, 0.1, "lower"), ("c", "digits-mlp", 0, "equal"),
               ("d", True, 0, "equal"))
    failures = goldens.compare(g, {"b": "nan", "c": "digits-cnn", "d": True})
    assert len(failures) == 3
    assert "'a' was not recorded" in failures[0]
    assert "finite" in failures[1] and "differs" in failures[2]


def test_bad_golden_definitions_are_refused():
    with pytest.raises(ValueError, match="direction"):
        GoldenMetric("m", 1.0, 0.1, "up")
    with pytest.raises(ValueError, match="tolerance"):
        GoldenMetric("m", 1.0, -1, "higher")
    with pytest.raises(ValueError, match="needs a number"):
        GoldenMetric("m", "text", 0, "higher")


def test_load_checks_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no golden file"):
        goldens.load(tmp_path / "nope.json")
    bad = tmp_path / "x.json"
    bad.write_text('{"notebook": "x"}')
    with pytest.raises(ValueError, match="malformed"):
        goldens.load(bad)
    bad.write_text(json.dumps({"notebook": "y", "metrics": []}))
    with pytest.raises(ValueError, match="names notebook 'y'"):
        goldens.load(bad)


def test_every_shipped_golden_loads():
    names = [g.notebook for g in goldens.load_all()]
    assert "90_report" in names and len(names) == len(set(names))


def test_update_keeps_tolerance_and_direction(tmp_path):
    path = tmp_path / "app.json"
    path.write_text(json.dumps({"notebook": "app", "parameters": {"threads": 1},
                                "metrics": [{"metric": "m", "value": 1.0, "tolerance": 0.2, "direction": "lower"}]}))
    g = goldens.load(path)
    with pytest.raises(ValueError, match="did not record"):
        goldens.update(g, {"other": 3})
    goldens.update(g, {"m": 0.5, "other": 3})
    again = goldens.load(path)
    assert again.metrics[0] == GoldenMetric("m", 0.5, 0.2, "lower") and again.parameters == {"threads": 1}


@pytest.mark.slow
def test_goldens_command_fails_on_a_regression(tmp_path, capsys):
    """A golden the notebook cannot meet (more points than it makes) fails the command, naming the metric."""
    shipped = goldens.load("app").to_json()
    for m in shipped["metrics"]:
        if m["metric"] == "points":
            m["value"] = 5
    path = tmp_path / "app.json"
    path.write_text(json.dumps(shipped))
    assert main(["goldens", str(path), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "app: metric 'points' expected 5" in err and "found 1" in err
    assert json.loads(path.read_text())["metrics"] == shipped["metrics"]   # never rewritten without --update


def test_a_conditional_metric_is_checked_only_when_its_condition_holds():
    g = Golden("50_kernels", [GoldenMetric("speedup", 2.5, 1.0, "higher", when={"cpu_int8_dot_product": True})])
    assert goldens.compare(g, {"speedup": 0.02, "cpu_int8_dot_product": True})          # a regression there
    assert goldens.compare(g, {"speedup": 0.02, "cpu_int8_dot_product": False}) == []   # not this CPU's claim
    assert "not checked" in goldens.not_applicable(g, {"speedup": 0.02, "cpu_int8_dot_product": False})[0]
    assert "was not recorded" in goldens.compare(g, {"speedup": 3.0})[0]                 # the condition must be
    assert json.loads(json.dumps(g.to_json()))["metrics"][0]["when"] == {"cpu_int8_dot_product": True}


def test_measured_values_are_recorded_per_cpu_class_and_checked(tmp_path):
    path = tmp_path / "10_number_formats.json"
    path.write_text(json.dumps(golden(("m", 1.0, 0.1, "lower"), ("c", 2.0, 0.0, "equal"),
                                      ("s", 3.0, 1.0, "higher")).to_json()))
    g = goldens.load(path)
    g.metrics[2].when = {"c": 9.0}   # not applicable in these runs: left without a measurement
    goldens.record_measured(g, "native", {"m": 1.0, "c": 2.0, "s": 0.1})
    goldens.record_measured(g, "avx2", {"m": 1.25, "c": 2.0, "s": 0.1})
    again = goldens.load(path)
    assert again.metrics[0].measured == {"native": 1.0, "avx2": 1.25} and again.metrics[0].value == 1.0
    assert again.metrics[2].measured is None
    problems = goldens.measured_problems(again)
    assert len(problems) == 1 and "'m'" in problems[0] and "as avx2" in problems[0] and "rose by 0.25" in problems[0]
    with pytest.raises(ValueError, match="unknown CPU class"):
        goldens.record_measured(again, "zen9", {"m": 1.0, "c": 2.0})
    with pytest.raises(ValueError, match="did not record"):
        goldens.record_measured(again, "avx512", {"m": 1.0})
    with pytest.raises(ValueError, match="measured must map"):
        GoldenMetric("m", 1.0, 0.1, "lower", measured=[1.0])


def test_measure_needs_a_cpu_class(capsys):
    assert main(["goldens", "app", "--measure"]) != 0
    assert "--measure records values under a CPU class" in capsys.readouterr().err


# the CPU classes every shipped golden was measured under (workbench_kernels.isa.EMULATED)
MEASURED_CLASSES = ("native", "avx512", "avx2", "default")


@pytest.mark.parametrize("g", goldens.load_all(), ids=lambda g: g.notebook)
def test_every_tolerance_holds_the_values_measured_on_every_cpu_class(g):
    """No golden is narrower than the spread its metrics showed across the emulated CPU classes (recorded with
    `workbench goldens --cpu-class C --measure`), and every metric checked on every CPU was measured on each."""
    assert goldens.measured_problems(g) == []
    for m in g.metrics:
        if m.when:   # a hardware-conditional metric: measured where its condition held
            continue
        assert m.measured and set(MEASURED_CLASSES) <= set(m.measured), \
            f"{g.notebook}: metric {m.metric!r} measured on {sorted(m.measured or {})}, not on every CPU class"
