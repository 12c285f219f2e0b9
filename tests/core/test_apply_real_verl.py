"""Registry mechanics against the real verl 0.4.1: apply, alias rebinding, idempotency, undo, strictness."""

import dataclasses

import pytest

import fixture_patches as fx  # tests/fixtures, put on sys.path by conftest

from verl_patches.core import apply as ap


@pytest.fixture
def clean():
    yield
    ap.undo()


def _upstream():
    import verl.trainer.ppo.reward as trainer_reward
    import verl.utils.reward_score as rs
    import verl.workers.reward_manager.naive as naive

    return rs, naive, trainer_reward


def test_apply_rebinds_earlier_aliases_and_undo_restores(clean):
    rs, naive, trainer_reward = _upstream()
    # These modules did `from verl.utils.reward_score import default_compute_score` before the patch.
    from verl.utils.reward_score import default_compute_score as my_alias_before

    original = rs.default_compute_score
    assert naive.default_compute_score is original and trainer_reward.default_compute_score is original

    assert ap.apply_all([fx.GOOD]) == ["fixture.count_calls"]
    patched = rs.default_compute_score
    assert patched is not original and patched.__verl_patch_original__ is original
    assert naive.default_compute_score is patched and trainer_reward.default_compute_score is patched
    # The behaviour through an alias bound before the patch: a reward manager module's name.
    fx.CALLS.clear()
    assert naive.default_compute_score("fixture/always_one", "x", "y") == 1.0
    assert naive.default_compute_score("openai/gsm8k", "#### 7", "7") == 1.0  # original still reached
    assert fx.CALLS == ["fixture/always_one", "openai/gsm8k"]
    # A local name is no module attribute: it keeps the original; a new import gets the patch.
    assert my_alias_before is original
    from verl.utils.reward_score import default_compute_score as after

    assert after is patched

    # Applying again changes nothing: no wrapper around the wrapper.
    assert ap.apply_all([fx.GOOD]) == []
    assert rs.default_compute_score is patched

    assert ap.undo() == ["fixture.count_calls"]
    assert rs.default_compute_score is original
    assert naive.default_compute_score is original and trainer_reward.default_compute_score is original
    with pytest.raises(NotImplementedError):
        original("fixture/always_one", "x", "y")


def test_wrong_fingerprint_raises_naming_patch_target_and_version(clean):
    rs, _, _ = _upstream()
    before = rs.default_compute_score
    with pytest.raises(ap.PatchError) as e:
        ap.apply_all([fx.WRONG_FINGERPRINT])
    msg = str(e.value)
    assert "fixture.wrong_fingerprint" in msg and fx.TARGET in msg and "verl 0.4.1" in msg
    assert "upstream changed" in msg
    assert rs.default_compute_score is before


def test_missing_target_is_never_created(clean):
    rs, _, _ = _upstream()
    with pytest.raises(ap.PatchError, match="does not exist"):
        ap.apply_all([fx.MISSING_TARGET])
    assert not hasattr(rs, "no_such_function")


def test_version_outside_range_is_refused(clean):
    with pytest.raises(ap.PatchError, match=r"0\.4\.1 is outside the supported range '>=0\.5'"):
        ap.apply_all([fx.WRONG_VERSION])


def test_failure_midway_undoes_what_the_call_applied(clean):
    rs, _, _ = _upstream()
    original = rs.default_compute_score
    with pytest.raises(ap.PatchError):
        ap.apply_all([fx.GOOD, fx.MISSING_TARGET])
    assert rs.default_compute_score is original and ap.applied() == {}


def test_two_patches_on_one_target_stack_in_order_and_unstack(clean):
    rs, naive, _ = _upstream()
    original = rs.default_compute_score
    second = dataclasses.replace(fx.GOOD, id="fixture.count_calls_2")
    ap.apply_all([fx.GOOD, second])
    outer = rs.default_compute_score
    assert outer.__verl_patch_id__ == "fixture.count_calls_2"
    assert outer.__verl_patch_original__.__verl_patch_id__ == "fixture.count_calls"
    assert naive.default_compute_score is outer
    # Re-applying the inner patch (e.g. the prelude running again) must not wrap it again.
    assert ap.apply_all([fx.GOOD, second]) == []
    assert rs.default_compute_score is outer
    ap.undo()
    assert rs.default_compute_score is original and naive.default_compute_score is original


def test_method_target_keeps_descriptor_kind(clean):
    import verl.protocol as proto

    target = "verl.protocol:DataProto.concat"  # a staticmethod in verl 0.4.1
    from verl_patches.core.fingerprint import fingerprint_file

    fp = fingerprint_file(proto.__file__, "DataProto.concat")
    p = fx.make("fixture.concat", "fixture_patches", target=target, fingerprint=fp,
                replacement="fixture_patches:wrap_passthrough")
    raw_before = proto.DataProto.__dict__["concat"]
    assert isinstance(raw_before, staticmethod)
    ap.apply_all([p])
    assert isinstance(proto.DataProto.__dict__["concat"], staticmethod)
    assert proto.DataProto.concat.__verl_patch_id__ == "fixture.concat"
    ap.undo()
    assert proto.DataProto.__dict__["concat"] is raw_before


def test_a_class_swapped_for_a_subclass_after_the_patch_is_still_reached_or_refused(clean, monkeypatch):
    """MindSpeed's patches manager puts subclasses in the place of megatron's classes after the prelude patched
    them (its swap optimizer for DistributedOptimizer); the prelude runs again in later processes' plugin hooks.
    A subclass that inherits the patched method: nothing to do. One that overrides it: an error naming it."""
    import verl.protocol as proto
    from verl_patches.core.fingerprint import fingerprint_file

    fp = fingerprint_file(proto.__file__, "DataProto.concat")
    p = fx.make("fixture.concat", "fixture_patches", target="verl.protocol:DataProto.concat", fingerprint=fp,
                replacement="fixture_patches:wrap_passthrough")
    base = proto.DataProto
    assert ap.apply_all([p]) == ["fixture.concat"]

    class Inherits(base):
        pass

    monkeypatch.setattr(proto, "DataProto", Inherits)
    assert ap.apply_all([p]) == []
    assert Inherits.concat.__verl_patch_id__ == "fixture.concat"

    class Overrides(base):
        @staticmethod
        def concat(data):
            return data

    monkeypatch.setattr(proto, "DataProto", Overrides)
    with pytest.raises(ap.PatchError, match=r"is now .*Overrides, whose concat comes from .*Overrides and is not the "
                                            r"patched one"):
        ap.apply_all([p])
    monkeypatch.setattr(proto, "DataProto", base)
