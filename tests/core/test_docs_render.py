"""docs/PATCHES.md must not depend on which optional upstreams a machine has: a patch whose upstream
is not installed keeps its committed *upstream lines*, and only those of the same locked release."""

from __future__ import annotations

from verl_patches.core import docs
from verl_patches.core.docs import NOT_INSTALLED, committed_upstream_lines, render_patches_md
from verl_patches.patches import load_catalogue


def _pretend_missing(monkeypatch, patch_id):
    real = docs.upstream_lines

    def lines(p, root=None):
        if p.id == patch_id:
            return real(p, root).split(" ")[0] + " " + real(p, root).split(" ")[1] + " " + NOT_INSTALLED
        return real(p, root)

    monkeypatch.setattr(docs, "upstream_lines", lines)


def test_committed_lines_are_read_back_for_every_patch():
    patches = load_catalogue()
    text = render_patches_md(patches)
    found = committed_upstream_lines(text)
    assert set(found) == {p.id for p in patches}
    assert all(found[p.id] == docs.upstream_lines(p) for p in patches)


def test_an_upstream_missing_here_keeps_the_committed_lines(monkeypatch):
    patches = load_catalogue()
    pid = "verl.reward_score.deepscaler"
    committed = render_patches_md(patches)
    # Patches whose upstream this machine lacks anyway (MindSpeed on a CI machine) are unread too.
    already: list[str] = []
    render_patches_md(patches, committed, already)
    assert pid not in already
    _pretend_missing(monkeypatch, pid)
    unread: list[str] = []
    assert render_patches_md(patches, committed, unread) == committed
    assert sorted(unread) == sorted(already + [pid])
    # Without a committed entry the document says so rather than inventing lines.
    fresh = committed_upstream_lines(render_patches_md(patches))
    assert fresh[pid].endswith(NOT_INSTALLED)


def test_a_committed_entry_of_another_release_is_not_kept(monkeypatch):
    patches = load_catalogue()
    pid = "verl.reward_score.deepscaler"
    committed = render_patches_md(patches)
    old = committed_upstream_lines(committed)[pid]
    component, version, rest = old.split(" ", 2)
    stale = committed.replace(old, f"{component} 0.0.0-other {rest}")
    _pretend_missing(monkeypatch, pid)
    assert committed_upstream_lines(render_patches_md(patches, stale))[pid].endswith(NOT_INSTALLED)
