"""Check a Dockerfile's stages as far as a machine without a container engine can.

``python docker/check.py [-f docker/Dockerfile] [--index]``: every COPY source exists in the build context,
every RUN body passes shellcheck (as bash, with the file's ARG / ENV names declared), and with --index every
``package==version`` a RUN installs (after ARG defaults are filled in) exists on pip's configured index.
Exit 1 on any failure; each failure names the line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str] = field(default_factory=dict)
    env: list[str] = field(default_factory=list)
    runs: list[tuple[int, str]] = field(default_factory=list)  # (first line number, body)
    copies: list[tuple[int, str]] = field(default_factory=list)  # (line number, source)
    froms: list[tuple[int, str]] = field(default_factory=list)


def parse(path: Path) -> Dockerfile:
    df = Dockerfile(path)
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        start, text = i + 1, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            nxt = lines[i]
            if nxt.lstrip().startswith("#"):
                continue
            text = text.rstrip()[:-1] + " " + nxt  # Docker joins continued lines into one
        i += 1
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        word, _, rest = stripped.partition(" ")
        word = word.upper()
        if word == "ARG":
            name, _, default = rest.partition("=")
            df.args[name.strip()] = default.strip().strip('"')
        elif word == "ENV":
            df.env += re.findall(r"(\w+)=", rest)
        elif word == "RUN":
            df.runs.append((start, rest))
        elif word == "COPY":
            srcs = [w for w in rest.split() if not w.startswith("--")][:-1]
            df.copies += [(start, s) for s in srcs]
        elif word == "FROM":
            df.froms.append((start, rest))
    return df


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def check_copies(df: Dockerfile, context: Path) -> list[str]:
    return [f"{df.path.name}:{n}: COPY source {src} is not in the build context {context}"
            for n, src in df.copies if not (context / src).exists()]


def check_runs(df: Dockerfile, shellcheck: str) -> list[str]:
    declared = "".join(f'{name}="${{{name}:-x}}"\n' for name in [*df.args, *df.env])
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, body in df.runs:
            script = Path(tmp) / f"run_{n}.sh"
            # -o pipefail as the Dockerfile's SHELL sets it; the declarations keep ARG references defined.
            script.write_text(f"#!/usr/bin/env bash\nset -o pipefail\n{declared}{body}\n")
            r = subprocess.run([shellcheck, "-s", "bash", "-e", "SC2034", str(script)], capture_output=True,
                               text=True)
            if r.returncode:
                problems.append(f"{df.path.name}:{n}: RUN body fails shellcheck:\n{r.stdout}")
    return problems


def pinned_packages(df: Dockerfile) -> list[tuple[int, str, str]]:
    out = []
    for n, body in df.runs:
        if "pip" not in body:
            continue
        for name, version in re.findall(r'"?([A-Za-z0-9_.\-]+(?:\[[\w,]+\])?)==([0-9][\w.+\-]*)"?', expand(body, df.args)):
            out.append((n, re.sub(r"\[.*\]", "", name), version))
    return out


def check_index(df: Dockerfile, python: str) -> list[str]:
    problems = []
    for n, name, version in pinned_packages(df):
        r = subprocess.run([python, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                           capture_output=True, text=True, timeout=120)
        listed = re.search(r"Available versions: (.*)", r.stdout)
        versions = {v.strip() for v in listed.group(1).split(",")} if listed else set()
        if version not in versions:
            problems.append(f"{df.path.name}:{n}: {name}=={version} not found on pip's configured index "
                            f"({(r.stderr or r.stdout).strip()[:200] or 'no versions listed'})")
        else:
            print(f"ok   {name}=={version} on the index")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python docker/check.py", description=__doc__)
    p.add_argument("-f", "--file", type=Path, default=ROOT / "docker" / "Dockerfile")
    p.add_argument("--context", type=Path, default=ROOT)
    p.add_argument("--index", action="store_true", help="also look every pinned package up on pip's index")
    p.add_argument("--shellcheck", default=shutil.which("shellcheck") or "shellcheck")
    args = p.parse_args(argv)
    df = parse(args.file)
    problems = check_copies(df, args.context)
    if shutil.which(args.shellcheck) is None:
        problems.append(f"shellcheck not found ({args.shellcheck}); RUN bodies unchecked")
    else:
        problems += check_runs(df, args.shellcheck)
    if args.index:
        problems += check_index(df, sys.executable)
    print(f"{args.file.name}: {len(df.froms)} stage(s), {len(df.runs)} RUN, {len(df.copies)} COPY source(s), "
          f"{len(pinned_packages(df))} pinned package(s)")
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
