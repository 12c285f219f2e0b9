"""One declaration per command-line option: its type, range and finiteness, and the environment
variable that sets the same thing, if any.

Every entry point (``python -m verl_patches ...``, the ``verl_patches.tools`` modules, the scripts'
Python parts) declares each option once, in its ``add_argument`` call: ``type=`` is one of the
rules below (``Number``, ``Integer``, ``Text``, ``PathArg``), or the option has ``choices``, or it
takes no value (a flag). A rule is the argparse type: a value it refuses ends the command with
``argument --OPT: 'VALUE': expected RULE`` (exit 2), so every refusal names the option, the value
and the rule. ``parse_args(parser, argv)`` parses and then refuses an option given together with
an environment variable of the same setting that holds another value (``env=`` on the rule):
neither silently wins.

The property suite (tests/test_properties.py, ``test_every_entry_point_declares_its_options``)
finds every entry point in the source tree, reads its parser's declarations and generates bad
values from them (``Rule.bad_values``); an option without a declaration fails it.
This module imports the standard library and, of the package, only its neighbour ``base.env`` (the typed
reader of a rule's environment variable, ``env=``): the doctor and the CLI read it without torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from verl_patches.base import env as overlay_env


class Rule:
    """A declared option type; calling it parses one command-line value (argparse's ``type=``)."""

    kind = "text"

    def __init__(self, env: str | None = None, doc: str = "") -> None:
        self.env = env  # an environment variable that sets the same thing
        self.doc = doc  # said with a refusal: why the rule is what it is

    @property
    def __name__(self) -> str:  # argparse names the type in some messages
        return self.kind

    def allowed(self) -> str:
        raise NotImplementedError

    def check(self, raw: str) -> Any:
        raise NotImplementedError

    def __call__(self, raw: str) -> Any:
        try:
            return self.check(raw)
        except (ValueError, TypeError, OverflowError) as e:
            why = f" ({e})" if str(e) else ""
            doc = f"; {self.doc}" if self.doc else ""
            raise argparse.ArgumentTypeError(f"{raw!r}: expected {self.allowed()}{why}{doc}") from None

    def bad_values(self) -> list[str]:
        """Values this declaration refuses (the property suite passes each to the entry point)."""
        return ["\0"]

    def example(self) -> str:
        """A value this declaration accepts (what the property suite puts before a bad positional value)."""
        return "x"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.allowed()})"


class Number(Rule):
    """A finite real number within [low, high] (``low_open``: strictly above ``low``)."""

    kind = "number"

    def __init__(self, low: float | None = None, high: float | None = None, low_open: bool = False,
                 env: str | None = None, doc: str = "") -> None:
        super().__init__(env, doc)
        self.low, self.high, self.low_open = low, high, low_open

    def _convert(self, text: str) -> Any:
        return float(text)

    def allowed(self) -> str:
        def show(x: float) -> str:
            return str(int(x)) if self.kind == "integer" else f"{x:g}"

        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {show(self.low)}")
        if self.high is not None:
            parts.append(f"<= {show(self.high)}")
        what = "a finite number" if self.kind == "number" else "a whole number"
        return what + (" " + " and ".join(parts) if parts else "")

    def check(self, raw: str) -> Any:
        text = raw.strip()
        if not text or "_" in text:
            raise ValueError("")
        value = self._convert(text)
        if not math.isfinite(value):
            raise ValueError("")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise ValueError("")
        if self.high is not None and value > self.high:
            raise ValueError("")
        return value

    def bad_values(self) -> list[str]:
        out = ["", "abc", "nan", "inf", "-inf", "1e400", "1_0"]
        if self.low is not None:
            out.append(repr(self.low) if self.low_open else repr(self.low - 1))
        if self.high is not None:
            out.append(repr(self.high * 2 + 1))
        return out

    def example(self) -> str:
        x = 1 if self.low is None else self.low + (1 if self.low_open else 0)
        x = x if self.high is None else min(x, self.high)
        return str(int(x)) if self.kind == "integer" else repr(float(x))

    def accepts(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high


class Integer(Number):
    kind = "integer"

    def _convert(self, text: str) -> Any:
        return int(text)

    def bad_values(self) -> list[str]:
        return [*super().bad_values(), "1.5", "1e3"]

    def accepts(self, value: float) -> bool:
        return float(value).is_integer() and super().accepts(value)


class Text(Rule):
    """Free text: non-empty (unless ``empty``), no NUL byte, at most ``max_len`` characters."""

    def __init__(self, empty: bool = False, max_len: int = 4096, env: str | None = None, doc: str = "") -> None:
        super().__init__(env, doc)
        self.empty, self.max_len = empty, max_len

    def allowed(self) -> str:
        return f"{'' if self.empty else 'non-empty '}text without NUL bytes, at most {self.max_len} characters"

    def check(self, raw: str) -> Any:
        if "\0" in raw or len(raw) > self.max_len or (not self.empty and not raw.strip()):
            raise ValueError("")
        return raw

    def bad_values(self) -> list[str]:
        return ["\0", "x" * (self.max_len + 1), *([] if self.empty else ["", " "])]


class PathArg(Text):
    """A file system path (``role`` says which: an input file, an output directory, ...); it exists or is
    writable is checked by the command, with its own message, when it reads or writes it."""

    kind = "path"

    def __init__(self, role: str = "path", env: str | None = None, doc: str = "") -> None:
        super().__init__(empty=False, max_len=4096, env=env, doc=doc)
        self.role = role

    def allowed(self) -> str:
        return f"a path ({self.role}): non-empty, without NUL bytes"

    def check(self, raw: str) -> Any:
        return Path(super().check(raw))


class Renamed(argparse.Action):
    """An option that was renamed: given, with or without a value, it ends the command naming the new name
    (exit 2), so an old command line fails instead of meaning something else. Hidden from --help."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        got = "" if values is None else f", got {values!r}"
        raise argparse.ArgumentError(self, f"renamed {self.new} (same meaning, same values): expected {self.new}{got}")


def refuse_renamed(parser: argparse.ArgumentParser, renamed: Mapping[str, str]) -> None:
    """Declare each old option name of ``renamed`` (old -> new) as refused, naming its new name."""
    for old, new in renamed.items():
        parser.add_argument(old, action=Renamed, new=new, dest=f"renamed_{old.lstrip('-').replace('-', '_')}",
                            default=None)


def declared(action: argparse.Action) -> bool:
    """Whether an option's values are declared: a flag, a rule, a closed set of choices, or a renamed option
    (refused whatever its value)."""
    if action.nargs == 0 or isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                                 argparse._SubParsersAction, Renamed)):
        return True
    return isinstance(action.type, Rule) or action.choices is not None


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def disagreements(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str],
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per option given on the command line whose environment variable holds another value."""
    env = os.environ if environ is None else environ
    out = []
    for a in parser._actions:
        rule = a.type
        if not isinstance(rule, Rule) or not rule.env or not (env.get(rule.env) or "").strip():
            continue
        given = [o for o in a.option_strings if any(x == o or x.startswith(o + "=") for x in argv)]
        value = getattr(args, a.dest, None)
        # Given: named on the command line, or (an abbreviation argparse accepts) a value other than the default.
        if value is None or (not given and value == a.default):
            continue
        given = given or a.option_strings[:1]
        raw = env[rule.env]
        try:
            var = overlay_env.BY_NAME.get(rule.env)
            other = overlay_env.parse(var, raw) if var is not None else rule.check(raw)
        except (ValueError, TypeError):
            out.append(f"{given[0]} {value!r} is given and {rule.env}={raw!r} is set to a value that is not "
                       f"{rule.allowed()}: unset {rule.env} or correct it")
            continue
        if other != value:
            out.append(f"{given[0]} {value!r} and {rule.env}={raw!r} disagree (both set the same thing): give "
                       f"one of them, or the same value in both")
    return out


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then refuse options that disagree with their environment variable."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    bad = disagreements(parser, args, argv, environ)
    if bad:
        parser.error("; ".join(bad))
    return args


class IntList(Rule):
    """Comma-separated whole numbers, each within [low, high]."""

    kind = "list of whole numbers"

    def __init__(self, low: int | None = None, high: int | None = None, env: str | None = None, doc: str = "") -> None:
        super().__init__(env, doc)
        self.item = Integer(low=low, high=high)

    def allowed(self) -> str:
        return f"comma-separated whole numbers, each {self.item.allowed().removeprefix('a whole number').strip() or 'any'}"

    def check(self, raw: str) -> Any:
        if not raw.strip():
            raise ValueError("")
        return tuple(self.item.check(x) for x in raw.split(","))

    def example(self) -> str:
        return self.item.example()

    def bad_values(self) -> list[str]:
        return ["", "1,,2", "1,x", "1,nan", *[f"1,{v}" for v in self.item.bad_values() if v and "," not in v][:4]]
