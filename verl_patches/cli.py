"""``python -m verl_patches``: doctor, patches, diff, docs, hook, fingerprint, plan, preflight, plot, rollout-plan,
layer-spec."""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json
import sys
from dataclasses import asdict

from verl_patches.rigs import npu_rehearsal
from verl_patches.base.schema import PathArg, Text
from verl_patches.core import hook
from verl_patches.core.docs import upstream_lines, PATCHES_MD, render_patches_md
from verl_patches.core.doctor import as_json, run_doctor, is_failing, env_findings, layer_spec_finding
from verl_patches.core.fingerprint import TargetNotFound, source_span, fingerprint_file
from verl_patches.core.upstream import module_file
from verl_patches.patches import load_catalogue, get_patch

# Subcommands implemented by an engine's own CLI module: name -> "module:function(argv) -> int".
DELEGATED = {
    "plan": ("verl_patches.reshard.cli:main", "reshard plan for a model and two layouts (ours vs baselines)"),
    "preflight": ("verl_patches.preflight.cli:main", "rehearse train/rollout switches and verify the shards"),
    "plot": ("verl_patches.reporting.plot:main", "PNG curves of a run (its metrics.jsonl or tensorboard event files)"),
    "layer-spec": ("verl_patches.checks.layer_spec:main",
                   "Ascend: the classes DeepSeek-V3's layer spec resolves to for a run's config, with their releases"),
    "rollout-plan": ("verl_patches.rollout.long_tail.simulator:main",
                     "model the rollout's long tail (lockstep DP decode, graph sizes, rebalance) and recommend"),
}


def _platform_default() -> str:
    # Lazy: accelerator imports torch; only the doctor asks it, the other verbs and --help run without torch.
    from verl_patches.base import accelerator

    return accelerator.device_type()


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.upstream_root is not None and not args.upstream_root.is_dir():
        print(f"error: --upstream-root {args.upstream_root} is not a directory", file=sys.stderr)
        return 2

    # The overlay's own variables that are set, each ok or invalid (none set: no line, no entry).
    settings = env_findings()
    if any(s.failed for s in settings):
        # Before anything that reads them (the platform, the registry, the lock).
        if args.json:
            print(json.dumps(as_json(settings), indent=2))
        for f in settings if not args.json else ():
            print(f.line())
        print(f"doctor: {sum(s.failed for s in settings)} invalid environment setting(s): "
              f"{', '.join(s.id for s in settings if s.failed)}", file=sys.stderr)
        return 1
    platform = args.platform or _platform_default()
    findings, code = run_doctor(load_catalogue(), platform, args.upstream_root, strict=args.strict)
    spec_lines: list[str] = []
    if platform == "npu":
        # The classes the run's ranks build DeepSeek-V3 from (a child process: core/doctor.py's docstring says why).
        spec, spec_lines = layer_spec_finding(args.layer_spec, args.overrides, args.upstream_root,
                                              npu_rehearsal.SITE if npu_rehearsal.selected() else None)
        findings.append(spec)
        code = code or int(is_failing(spec, args.strict))
    if args.json:
        print(json.dumps(as_json(findings + settings), indent=2))
        return code
    for f in findings + settings:
        print(f.line())

    for i, line in enumerate(spec_lines):  # the header, then one line per class
        print(("  " if i else "") + line)
    if platform == "npu" or npu_rehearsal.selected():
        # Which torch_npu is in use: the real one, or the NPU rehearsal platform's stand-in (never both).
        print(npu_rehearsal.describe())
    bad = [f for f in findings if is_failing(f, args.strict)]
    notes = [f for f in findings if f.status != "ok" and f.id.startswith("lock:") and f not in bad]
    mode = "strict" if args.strict else "patches and presence; --strict also enforces the lock's versions"
    print(f"doctor ({platform}, {mode}): {len(findings)} checked, "
          f"{sum(f.status == 'ok' for f in findings)} ok, {len(bad)} failing"
          + ("" if args.strict else f", {len(notes)} lock notes"))
    if bad:
        print(f"doctor: {len(bad)} failing: {', '.join(f.id for f in bad)}", file=sys.stderr)
    return code


def cmd_patches(args: argparse.Namespace) -> int:
    patches = load_catalogue()
    if args.json:
        rows = []
        for p in patches:
            d = asdict(p)
            d["fingerprint"] = {"signature": p.fingerprint.signature, "source_sha": p.fingerprint.source_sha}
            d.pop("extra", None)
            d["upstream_lines"] = upstream_lines(p)
            rows.append(d)
        print(json.dumps(rows, indent=2))
        return 0
    if not patches:
        print("no patches registered")
    for p in patches:
        deps = f"  (requires {', '.join(p.requires)})" if p.requires else ""
        print(f"{p.id:<40} {p.feature:<18} {p.kind:<8} {','.join(p.phases):<18} {p.target}{deps}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    try:
        patch = get_patch(args.id)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    path = module_file(patch.module, args.upstream_root)
    if path is None:
        print(f"error: upstream module {patch.module} not found", file=sys.stderr)
        return 1
    try:
        original = source_span(path, patch.qualname).text()
    except TargetNotFound as e:
        print(f"error: {patch.target}: {e} ({path})", file=sys.stderr)
        return 1
    ours_obj = patch.load_replacement()
    ours = inspect.getsource(ours_obj)
    ours_file = inspect.getsourcefile(ours_obj)
    label = "wrapper factory (receives the original)" if patch.kind == "wrap" else "replacement"
    sys.stdout.writelines(difflib.unified_diff(
        original.splitlines(keepends=True), ours.splitlines(keepends=True),
        fromfile=f"upstream {patch.target} ({path})",
        tofile=f"verl_patches {patch.replacement} ({ours_file}) [{label}]",
    ))
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    current = PATCHES_MD.read_text(encoding="utf-8") if PATCHES_MD.exists() else ""
    unread: list[str] = []
    text = render_patches_md(load_catalogue(), current, unread)
    if unread:
        print(f"note: upstream not installed here for {', '.join(unread)}: their *upstream lines* "
              f"are kept from {PATCHES_MD.name} as committed, not re-read", file=sys.stderr)
    if args.check:
        if current != text:
            print(f"{PATCHES_MD} is stale: run `python -m verl_patches docs --write`", file=sys.stderr)
            return 1
        print(f"{PATCHES_MD} is up to date")
        return 0
    if args.write:
        PATCHES_MD.parent.mkdir(parents=True, exist_ok=True)
        PATCHES_MD.write_text(text, encoding="utf-8")
        print(f"wrote {PATCHES_MD}")
        return 0
    sys.stdout.write(text)
    return 0


def cmd_hook(args: argparse.Namespace) -> int:
    try:
        if args.action == "install":
            changed, path = hook.install(args.upstream_root)
            print(f"{'added the prelude line to' if changed else 'already present in'} {path}")
            return 0
        if args.action == "remove":
            changed, path = hook.remove(args.upstream_root)
            print(f"{'removed the prelude line from' if changed else 'no prelude line in'} {path}")
            return 0
        present, path = hook.status(args.upstream_root)
        print(f"prelude line {'present' if present else 'MISSING'} in {path}")
        return 0 if present else 1
    except (FileNotFoundError, hook.HookError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_fingerprint(args: argparse.Namespace) -> int:
    module, sep, qualname = args.target.partition(":")
    path = module_file(module, args.upstream_root) if sep else None
    if path is None:
        print(f"error: {args.target!r}: expected module:qualname of an upstream module that exists", file=sys.stderr)
        return 1
    try:
        fp = fingerprint_file(path, qualname)
    except TargetNotFound as e:
        print(f"error: {e} ({path})", file=sys.stderr)
        return 1
    print(f'Fingerprint(signature={fp.signature!r}, source_sha="{fp.source_sha}")  # {path}')
    return 0


def _delegate(name: str, argv: list[str]) -> int:
    target, _ = DELEGATED[name]
    mod_name, _, func = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.startswith(e.name):
            print(f"error: `{name}` is not available in this checkout ({mod_name} is missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(mod, func)(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_patches", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("doctor", help="check upstream versions and every patch target (no upstream import)")
    d.add_argument("--upstream-root", type=PathArg("directory of upstream packages"), default=None,
                   help="directory holding copied-in upstream packages (default: what Python would import)")
    d.add_argument("--strict", action="store_true", help="also fail on lock mismatches and missing components")
    d.add_argument("--json", action="store_true", help="a JSON list of findings")
    d.add_argument("--platform", choices=("npu", "cuda", "cpu"), default=None,
                   help="judge required components for this platform (default: the detected one)")
    d.add_argument("--layer-spec", type=Text(), default="deepseekv3_256die_random_init",
                   help="NPU platform: the recipe config (configs/NAME.yaml) whose layer spec is resolved and checked "
                        "(python -m verl_patches layer-spec); elsewhere unused")
    d.add_argument("overrides", nargs="*", type=Text(), help="Hydra overrides of --layer-spec's config (after --)")
    d.set_defaults(func=cmd_doctor)

    ls = sub.add_parser("patches", help="list the registry")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_patches)

    df = sub.add_parser("diff", help="unified diff: upstream original vs our replacement")
    df.add_argument("id", type=Text())
    df.add_argument("--upstream-root", type=PathArg("directory of upstream packages"), default=None)
    df.set_defaults(func=cmd_diff)

    dc = sub.add_parser("docs", help="render docs/PATCHES.md from the registry")
    g = dc.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true", help="exit 1 if docs/PATCHES.md is stale")
    dc.set_defaults(func=cmd_docs)

    hk = sub.add_parser("hook", help="add/check/remove the prelude line in verl's worker module")
    hk.add_argument("action", choices=("install", "check", "remove"))
    hk.add_argument("--upstream-root", type=PathArg("directory of upstream packages"), default=None)
    hk.set_defaults(func=cmd_hook)

    fp = sub.add_parser("fingerprint", help="print the fingerprint of an upstream target (for new patch records)")
    fp.add_argument("target", type=Text(), help="module:qualname")
    fp.add_argument("--upstream-root", type=PathArg("directory of upstream packages"), default=None)
    fp.set_defaults(func=cmd_fingerprint)

    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))
