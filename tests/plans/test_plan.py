"""Plans: pattern matching, resolution, validation and the JSON round trip."""
import json

import pytest
import torch
from torch import nn

import workbench as wb
from workbench.plans import Plan
from workbench.precision import Cast


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(8, 8), "norm": nn.LayerNorm(8)}) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b["norm"](b["fc"](h))
        return self.head(h)


def names(assignments):
    return [a.name for a in assignments]


def test_exact_glob_regex():
    net = Net()
    bf16 = Cast(torch.bfloat16)
    assert names(Plan({"head": bf16}).resolve(net)) == ["head"]
    assert names(Plan({"blocks.*.fc": bf16}).resolve(net)) == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    assert names(Plan({"re:blocks\\.[02]\\.fc": bf16}).resolve(net)) == ["blocks.0.fc", "blocks.2.fc"]
    # a glob over containers assigns only the layers the technique supports (not LayerNorm, not ModuleDict)
    assert names(Plan({"blocks.1*": bf16}).resolve(net)) == ["blocks.1.fc"]


def test_first_match_wins_and_none_excludes():
    net = Net()
    plan = Plan({"blocks.0.fc": None, "head": Cast(torch.float16), "*": Cast(torch.bfloat16)})
    got = {a.name: a.config.dtype for a in plan.resolve(net)}
    assert got == {"emb": torch.bfloat16, "blocks.1.fc": torch.bfloat16, "blocks.2.fc": torch.bfloat16,
                   "head": torch.float16}


def test_unmatched_pattern_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"'blocks\.\*\.fcc' matches no layer"):
        Plan({"blocks.*.fcc": Cast()}).resolve(Net())
    with pytest.raises(ValueError, match=r"'blocks.0.norm' matches only layers that Cast cannot handle \(LayerNorm\)"):
        Plan({"blocks.0.norm": Cast()}).resolve(Net())


def test_bad_entries():
    with pytest.raises(TypeError, match="expected a technique config"):
        Plan({"head": "bf16"})
    with pytest.raises(ValueError, match="not a valid regular expression"):
        Plan({"re:(": Cast()})
    with pytest.raises(ValueError, match="non-empty string"):
        Plan({"": Cast()})
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        Plan({"head": Cast()}).resolve("not a model")


def test_json_round_trip(tmp_path):
    plan = Plan({"blocks.0.fc": None, "re:head": Cast(torch.float16), "*": Cast("bfloat16")})
    again = Plan.from_json(plan.to_json())
    assert again == plan and list(again) == list(plan)
    plan.save(tmp_path / "p.json")
    assert Plan.read(tmp_path / "p.json") == plan
    assert json.loads(plan.to_json())["version"] == wb.plans.PLAN_FORMAT_VERSION


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "unsupported plan format version 99"),
    (lambda d: d.update(format="other"), "not a workbench plan"),
    (lambda d: d["entries"][0]["config"].update(kind="os.system"), "unknown config kind 'os.system'"),
    (lambda d: d["entries"][0]["config"].update(evil=1), r"unknown field\(s\) \['evil'\]"),
    (lambda d: d["entries"][0]["config"].update(dtype={"dtype": "float64"}), "Cast.dtype must be one of"),
    (lambda d: d["entries"][0]["config"].update(dtype={"dtype": "nope"}), "unknown dtype 'nope'"),
])
def test_tampered_json_is_rejected(mutate, message):
    data = Plan({"head": Cast()}).to_dict()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(data)


def test_cast_validation():
    with pytest.raises(ValueError, match="Cast.dtype must be one of"):
        Cast(torch.int8)
    with pytest.raises(ValueError, match="Cast.dtype must be one of"):
        Cast("float33")
    assert Cast("float16").dtype is torch.float16
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        Cast().dtype = torch.float16


def test_describe_lists_assignments():
    df = Plan({"blocks.*.fc": Cast()}).describe(Net())
    assert list(df["layer"]) == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    assert set(df["pattern"]) == {"blocks.*.fc"}
