"""Features, dependencies and wrapping order between patch records: the registry refuses an
inconsistent catalogue, and the applier refuses a patch whose requirements are not in place."""

from __future__ import annotations

import dataclasses

import pytest

from tests.fixtures import fixture_patches as fx
from verl_patches.core import apply as A
from verl_patches.core.record import Patch, PatchDefinitionError
from verl_patches.core.registry import check_catalogue
from verl_patches.patches import in_application_order, load_catalogue


def _rec(pid: str, **over) -> Patch:
    return fx.make(pid, "tests.fixtures.fixture_patches", **over)


def test_the_real_catalogue_is_consistent_and_every_record_has_a_feature():
    patches = load_catalogue()  # runs check_catalogue
    assert all(p.feature for p in patches)
    # Every method wrapped by several records has a declared order.
    by_target: dict[str, list[Patch]] = {}
    for p in patches:
        by_target.setdefault(p.target, []).append(p)
    def together(p: Patch, q: Patch) -> bool:  # records of disjoint platforms never wrap in one process
        return p.platforms is None or q.platforms is None or bool(set(p.platforms) & set(q.platforms))

    chains = [ps for ps in by_target.values() if len(ps) > 1]
    assert chains and all({q.id for q in ps[:-1] if together(q, ps[-1])} <= set(ps[-1].after + ps[-1].requires)
                          for ps in chains)
    # The one target with records of disjoint platforms: DeepSeek-V3's layer spec, host (CPU) or MindSpeed-LLM's (NPU).
    spec = by_target["verl.models.mcore.model_initializer:DeepseekV3Model.get_transformer_layer_spec"]
    assert sorted(p.platforms for p in spec) == [("cpu",), ("npu",)]



def test_the_catalogue_lists_the_recipe_first_and_the_prelude_applies_the_cpu_platform_first():
    """The CPU platform's records (rigs/cpu/patches/) come after the recipe's in the catalogue and before them
    in the application order; each group keeps its order, and requires / after hold in both orders."""
    patches = load_catalogue()
    cpu = [p.id for p in patches if p.platforms == ("cpu",)]
    assert cpu and [p.id for p in patches][-len(cpu):] == cpu
    applied = in_application_order(patches)
    assert [p.id for p in applied] == cpu + [p.id for p in patches if p.id not in cpu]
    check_catalogue(applied)

@pytest.mark.parametrize("records,expected", [
    ([_rec("a", feature="no_such_feature")], "feature 'no_such_feature' is not one of"),
    ([_rec("a", requires=("ghost",))], "requires names 'ghost', which is no patch"),
    ([_rec("a", after=("b",)), _rec("b", after=())], "after names 'b', which comes later"),
    ([_rec("b", phases=("driver",)), _rec("a", phases=("driver", "worker"), requires=("b",), after=())],
     "requires 'b', which is not applied in ['worker']"),
    ([_rec("b", platforms=("npu",)), _rec("a", requires=("b",), after=())], "which applies only on ['npu']"),
    ([_rec("b", after=()), _rec("a", after=())], "must list 'b' in after="),
])
def test_an_inconsistent_catalogue_is_refused_naming_the_problem(records, expected):
    with pytest.raises(PatchDefinitionError, match=None) as e:
        check_catalogue(records)
    assert expected in str(e.value)


def test_a_record_without_a_feature_or_with_bad_dependencies_is_refused():
    with pytest.raises(PatchDefinitionError, match="feature is required"):
        _rec("a", feature="")
    with pytest.raises(PatchDefinitionError, match="requires"):
        _rec("a", requires=("a",))
    with pytest.raises(PatchDefinitionError, match="after"):
        _rec("a", after=["b"])


def test_the_applier_refuses_a_patch_whose_requirement_was_not_applied_and_binds_nothing():
    import verl.utils.reward_score as rs

    before = rs.default_compute_score
    needs = dataclasses.replace(fx.GOOD, id="fixture.needs_good", requires=(fx.GOOD.id,), after=())
    with pytest.raises(A.PatchError, match=r"requires \['fixture.count_calls'\], not applied in this process"):
        A.apply_one(needs)
    assert rs.default_compute_score is before
    try:
        assert A.apply_one(fx.GOOD) and A.apply_one(needs)
        # Undo in reverse order restores the original exactly.
    finally:
        A.undo([needs.id, fx.GOOD.id])
    assert rs.default_compute_score is before


def test_the_applier_refuses_to_wrap_inside_out():
    import verl.utils.reward_score as rs

    before = rs.default_compute_score
    outer = dataclasses.replace(fx.GOOD, id="fixture.outer", after=(fx.GOOD.id,))
    try:
        assert A.apply_one(outer)
        with pytest.raises(A.PatchError, match=r"must be applied before \['fixture.outer'\]"):
            A.apply_one(fx.GOOD)
    finally:
        A.undo([outer.id])
    assert rs.default_compute_score is before
