"""docs/WRITING_PATCHES.md against the real record and registry: every field of ``Patch`` is explained,
and the example module in the doc's python block is accepted by the registry's own checks (loaded as
a catalogue module beside the real ones), matches the installed verl's fingerprint, and applies."""

from __future__ import annotations

import dataclasses
import re
import sys
import types

import pytest

from tests.helpers import REPO
from verl_patches.core.record import Patch

DOC = REPO / "docs" / "WRITING_PATCHES.md"
EXAMPLE_MODULE = "verl_patches.patches.verl.patch_utils_seqlen_balancing"


def example_source() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, f"expected one python block in {DOC.name}, found {len(blocks)}"
    return blocks[0]


@pytest.fixture()
def example_module():
    assert EXAMPLE_MODULE not in sys.modules, "the example's module name is taken by a real module"
    mod = types.ModuleType(EXAMPLE_MODULE)
    exec(compile(example_source(), f"{DOC.name}:python", "exec"), mod.__dict__)  # noqa: S102 - our own doc
    sys.modules[EXAMPLE_MODULE] = mod
    try:
        yield mod
    finally:
        del sys.modules[EXAMPLE_MODULE]


def test_every_field_of_the_record_is_explained():
    text = DOC.read_text()
    missing = [f.name for f in dataclasses.fields(Patch) if f"`{f.name}`" not in text]
    assert not missing, f"{DOC.name} does not explain Patch fields {missing}"


def test_the_example_sets_every_field(example_module):
    (p,) = example_module.PATCHES
    assert isinstance(p, Patch)
    source = example_source()
    unset = [f.name for f in dataclasses.fields(Patch) if not re.search(rf"^\s+{f.name}=", source, flags=re.M)]
    assert not unset, f"the example record leaves {unset} out"


def test_the_registry_accepts_the_example(example_module):
    from verl_patches.core.registry import load_registry
    from verl_patches.patches import PATCH_MODULES

    records = load_registry(PATCH_MODULES + (EXAMPLE_MODULE,))
    (p,) = [r for r in records if r.module == "verl.utils.seqlen_balancing"]
    assert p.id == "verl.example.seqlen_balanced_partitions"
    assert callable(p.load_replacement())


def test_the_registry_would_refuse_the_example_with_a_fault(example_module):
    # The check above can fail: the same registry refuses the example with one field wrong.
    from verl_patches.core.record import PatchDefinitionError
    from verl_patches.core.registry import load_registry
    from verl_patches.patches import PATCH_MODULES

    (p,) = example_module.PATCHES
    example_module.PATCHES = [dataclasses.replace(p, requires=("no.such.patch",))]
    with pytest.raises(PatchDefinitionError, match="no.such.patch"):
        load_registry(PATCH_MODULES + (EXAMPLE_MODULE,))
    with pytest.raises(PatchDefinitionError, match="feature is required"):
        dataclasses.replace(p, feature="")


def test_the_examples_fingerprint_matches_the_installed_verl_and_it_applies(example_module):
    from verl_patches.core import apply as ap
    from verl_patches.core.doctor import check_patch
    from verl_patches.core.lock import load_lock

    (p,) = example_module.PATCHES
    finding = check_patch(p, load_lock(), "cpu", None)
    assert finding.status == "ok", finding.detail
    from verl.utils import seqlen_balancing

    want = seqlen_balancing.get_seqlen_balanced_partitions([5, 1, 4, 2], 2, False)
    ap.apply_all([p])
    try:
        assert seqlen_balancing.get_seqlen_balanced_partitions.__wrapped__ is not None
        assert seqlen_balancing.get_seqlen_balanced_partitions([5, 1, 4, 2], 2, False) == want
    finally:
        ap.undo([p.id])
    assert not hasattr(seqlen_balancing.get_seqlen_balanced_partitions, "__wrapped__")
