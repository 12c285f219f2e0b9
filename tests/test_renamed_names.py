"""Names apart (issue 38): the captured graph batch sizes are *graph sizes*, the offload engine's copy unit a
*copy chunk*, the reshard's transfer unit keeps *bucket*, megatron-core's own unit is its *DDP bucket*. Every
user-facing name that changed is refused under its old name, with an error naming the new one: an old config
or command line fails instead of being read with a default."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from tests.helpers import REPO
from verl_patches.base import schema
from verl_patches.config import settings
from verl_patches.rollout.long_tail import simulator
from verl_patches.rigs.testing import graph_switch


def test_the_old_recipe_key_is_refused_naming_the_new_one():
    old, new = "rebalance_min_bucket_drop", "rebalance_min_graph_size_drop"
    assert settings.RENAMED == {old: new} and new in settings.KEYS and old not in settings.KEYS
    found = settings.problems({old: 2})
    assert found == [f"{settings.SECTION}.{old} was renamed {settings.SECTION}.{new} (same meaning, same values): "
                     f"write {new} instead"]
    with pytest.raises(settings.SettingsError, match=f"{old} was renamed .*{new}"):
        settings.build({old: 2, new: 2})  # never both: the old name fails even beside the new one
    with pytest.raises(settings.SettingsError, match=f"was renamed .*{new}"):
        settings.read({old: 2}, old)
    assert settings.build({new: 2}).rebalance_min_graph_size_drop == 2


def test_no_config_or_doc_spells_the_old_key():
    for path in [*REPO.glob("configs/*.yaml"), REPO / "configs" / "README.md", REPO / "docs" / "ROLLOUT.md"]:
        assert "rebalance_min_bucket_drop" not in path.read_text(), path


@pytest.mark.parametrize("entry, old, new, ok", [
    ("rollout-plan", "--min-bucket-drop", "--min-graph-size-drop", ["--no-png"]),
    ("graph_switch", "--buckets", "--graph-sizes", ["--json", "x.json"]),
    ("bench_offload", "--bucket-mb", "--copy-chunk-mb", []),
])
def test_an_old_option_is_refused_naming_the_new_one(entry, old, new, ok, capsys, monkeypatch):
    captured = {}

    def capture(self, args=None, namespace=None):
        captured["parser"] = self
        raise SystemExit(0)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            if entry == "rollout-plan":
                simulator.main([])
            elif entry == "graph_switch":
                graph_switch.main([])
            else:
                spec = importlib.util.spec_from_file_location("_bench_offload", REPO / "scripts" / "bench_offload.py")
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                mod.main([])
    parser = captured["parser"]
    assert new in parser.format_help() and old not in parser.format_help()  # hidden from --help
    for argv in ([*ok, old, "2"], [*ok, f"{old}=2"], [*ok, old]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {old}: renamed {new}" in err and f"expected {new}" in err, err
    renamed = [a for a in parser._actions if isinstance(a, schema.Renamed)]
    assert [a.option_strings for a in renamed] == [[old]] and schema.declared(renamed[0])
