"""The typed parallel plan: fields, their checks, and mapping-style reads."""

import pytest

from mindtrain.config import ParallelPlan, ParamPlan, Region, UnitPlan


def _plan():
    params = {"emb.w": ParamPlan(shape=(8, 4), tp="vocab", tp_dim=0, unit="embedding", role="embedding",
                                 split_field="model.vocab_size"),
              "blk.attn.q": ParamPlan(shape=(4, 4), tp="column", tp_dim=0, unit="layers.0", role="attention"),
              "blk.norm": ParamPlan(shape=(4,), unit="layers.0")}
    units = [UnitPlan("embedding", "embedding", None, ["emb.w"], "emb"),
             UnitPlan("layers.0", "decoder", 0, ["blk.attn.q", "blk.norm"], "blk")]
    return ParallelPlan(params=params, units=units, regions=[Region("emb", "embedding"), Region("blk.attn", "attention")])


def test_plan_reads_by_attribute_and_by_key():
    plan = _plan()
    assert plan.params["emb.w"].tp == plan["params"]["emb.w"]["tp"] == "vocab"
    assert plan["params"]["blk.norm"].get("role") is None and plan["params"]["blk.norm"]["tp"] == "replicated"
    assert plan.get("shared") == {} and plan.get("missing", 7) == 7
    assert [u["path"] for u in plan["units"]] == ["emb", "blk"]
    assert plan.role_params("attention") == ["blk.attn.q"] and plan.role_regions("embedding") == ["emb"]
    with pytest.raises(KeyError):
        plan["nope"]


@pytest.mark.parametrize("make", [lambda: ParamPlan(shape=(1,), tp="diagonal"),
                                  lambda: ParamPlan(shape=(1,), role="decoder"),
                                  lambda: UnitPlan("x", "block"),
                                  lambda: Region("x", "router")])
def test_plan_rejects_unknown_styles_roles_and_kinds(make):
    with pytest.raises(ValueError):
        make()


def test_a_cell_class_declares_its_region():
    """The contract between a model's cells and the layouts: a class declares
    ``REGION = Region.declare(role)``; the plan finds it and places it at the cell's path."""

    class Attention:
        REGION = Region.declare("attention")

    class Untyped:
        REGION = "mlp"  # a bare string is no declaration

    assert Region.declared_by(Attention()) == Region("", "attention")
    assert Region.declared_by(Attention()).at("blk.attn") == Region("blk.attn", "attention")
    assert Region.declared_by(Untyped()) is None and Region.declared_by(object()) is None
    with pytest.raises(ValueError):
        Region.declare("router")
