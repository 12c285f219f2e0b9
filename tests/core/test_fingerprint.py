"""Fingerprints: formatting, comments and docstrings do not count; code and signatures do."""

import textwrap

import pytest

from verl_patches.core.fingerprint import TargetNotFound, fingerprint_file, source_span

BASE = '''
import os

class Worker:
    """Doc."""

    def step(self, x, y=1):
        """Step doc."""
        return x + y  # add

    @staticmethod
    def helper(a):
        return a

def free(a, *, b=2) -> int:
    return a * b

CONST = 3
'''


def _fp(tmp_path, src, qual, name="m.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(src))
    return fingerprint_file(p, qual)


def test_formatting_comments_docstrings_do_not_change_the_hash(tmp_path):
    reformatted = BASE.replace('"""Step doc."""', '"""Another doc."""').replace("x + y  # add", "(x\n                + y)")
    assert _fp(tmp_path, BASE, "Worker.step", "a.py") == _fp(tmp_path, reformatted, "Worker.step", "b.py")


def test_code_change_changes_the_hash_but_not_the_signature(tmp_path):
    a = _fp(tmp_path, BASE, "Worker.step", "a.py")
    b = _fp(tmp_path, BASE.replace("x + y", "x - y"), "Worker.step", "b.py")
    assert a.signature == b.signature and a.source_sha != b.source_sha


def test_signature_records_arguments_and_return(tmp_path):
    assert _fp(tmp_path, BASE, "free").signature == "def free(a, *, b=2) -> int"
    assert _fp(tmp_path, BASE, "Worker").signature == "class Worker()"
    changed = _fp(tmp_path, BASE.replace("y=1", "y=2"), "Worker.step", "c.py")
    assert changed.signature == "def step(self, x, y=2)"


def test_decorated_and_module_level_targets(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(textwrap.dedent(BASE))
    span = source_span(p, "Worker.helper")
    assert span.text().lstrip().startswith("@staticmethod")
    assert fingerprint_file(p, "CONST").signature == "CONST = 3"


@pytest.mark.parametrize("qual", ["Nope", "Worker.nope", "free.inner"])
def test_missing_target_is_named(tmp_path, qual):
    with pytest.raises(TargetNotFound, match="is not defined"):
        _fp(tmp_path, BASE, qual)
