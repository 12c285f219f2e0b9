"""Source-only upstream components (the lock's entries with an ``archive``): which release an installed
copy came from, and the install of the two that pip cannot build whole: Megatron-LM's training package,
which ships no setup.py, and MindSpeed-LLM, whose setup.py leaves out part of the package.

MindSpeed and MindSpeed-LLM report one version for every release (0.12.1 and 0.0.1), so the version
cannot say which release is installed. What can is the source pip records for a copy installed from a
URL (``direct_url.json``, PEP 610): the archive's sha256 (scripts/install_upstream_sources.sh installs
an archive by a ``file://...#sha256=`` address, which pip checks and records) or the git commit. The
doctor and the installer compare that record with the lock.

Megatron-LM's ``megatron/training`` and ``megatron/legacy`` are not a distribution upstream, and
MindSpeed-LLM's setup.py (``find_packages()``) leaves out every folder of ``mindspeed_llm`` without an
``__init__.py``: 45 of its 302 modules at v2.2.0, among them features_manager/transformer/
multi_latent_attention and flash_attention, which its own feature list imports (upstream runs it from the
checkout). ``install_tree`` writes the release's folders as they are into site-packages (Megatron's
beside megatron-core's ``megatron/core``: ``megatron`` is a namespace package there, megatron-core ships no
``megatron/__init__.py``), with a ``.dist-info`` of the lock's name and version whose RECORD lists every
file with its sha256 (so ``pip uninstall`` removes them and ``verify_record`` checks them) and whose
``direct_url.json`` records the archive's sha256 or the commit, as pip does for MindSpeed. No setup.py
runs: MindSpeed-LLM's would try to build an NPU extension where torch_npu imports.

Standard library only: the installer runs this file with the target environment's Python before the
overlay is installed (``python verl_patches/core/sources.py COMMAND ...``; ``--help`` lists them).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import json
import sys
import sysconfig
import tarfile
from pathlib import Path, PurePosixPath

INSTALLER = "verl-patches install_upstream_sources.sh"


def installed_source(dist_name: str) -> dict | None:
    """The source pip (or install_tree) recorded for the installed ``dist_name``: {"archive_sha256": ...},
    {"commit": ...}, {"other": URL} for a record that names neither (a directory, an editable install), or
    None where the distribution is absent or has no record (installed from an index, or by hand)."""
    try:
        text = md.distribution(dist_name).read_text("direct_url.json")
    except md.PackageNotFoundError:
        return None
    if not text:
        return None
    rec = json.loads(text)
    archive = rec.get("archive_info") or {}
    sha = (archive.get("hashes") or {}).get("sha256")
    if not sha and str(archive.get("hash", "")).startswith("sha256="):
        sha = archive["hash"].split("=", 1)[1]
    if sha:
        return {"archive_sha256": sha}
    commit = (rec.get("vcs_info") or {}).get("commit_id")
    if commit:
        return {"commit": commit}
    return {"other": rec.get("url", "?")}


def source_problem(dist_name: str, archive_sha256: str | None, commit: str | None) -> str | None:
    """None when the installed ``dist_name`` came from the lock's release (its archive or its commit),
    else what is wrong, in words."""
    src = installed_source(dist_name)
    if src is None:
        return f"{dist_name} records no source (no direct_url.json): which release it is cannot be told"
    if "archive_sha256" in src:
        if archive_sha256 and src["archive_sha256"] == archive_sha256:
            return None
        return f"{dist_name} was installed from an archive with sha256 {src['archive_sha256']}; the lock's is {archive_sha256}"
    if "commit" in src:
        if commit and src["commit"] == commit:
            return None
        return f"{dist_name} was installed from commit {src['commit']}; the lock pins {commit}"
    return f"{dist_name} was installed from {src['other']}, which records neither an archive sha256 nor a commit"


def _b64_sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def verify_record(dist_name: str) -> list[str]:
    """Files of the installed ``dist_name`` whose content differs from its RECORD, or that are gone."""
    dist = md.distribution(dist_name)
    bad = []
    for f in dist.files or []:
        if f.hash is None:
            continue
        path = Path(str(dist.locate_file(f)))
        if not path.is_file():
            bad.append(f"{f}: missing")
        elif _b64_sha256(path.read_bytes()) != f"{f.hash.mode}={f.hash.value}":
            bad.append(f"{f}: content differs from the record")
    return bad


def _members(archive: Path | None, tree: Path | None, paths: list[str]) -> list[tuple[str, bytes]]:
    """(path inside the repository, bytes) of every regular file under ``paths``, from a `git archive`
    tarball (one top folder) or from a checkout."""
    out = []
    if archive is not None:
        with tarfile.open(archive) as tf:
            for m in tf.getmembers():
                parts = PurePosixPath(m.name).parts[1:]  # drop the archive's top folder
                rel = "/".join(parts)
                if not m.isfile() or not any(rel == p or rel.startswith(p + "/") for p in paths):
                    continue
                if ".." in parts or PurePosixPath(m.name).is_absolute():
                    raise ValueError(f"{archive}: member {m.name!r} leaves its folder")
                out.append((rel, tf.extractfile(m).read()))
    else:
        for p in paths:
            for f in sorted((tree / p).rglob("*")):
                if f.is_file() and ".git" not in f.parts:
                    out.append((f.relative_to(tree).as_posix(), f.read_bytes()))
    return sorted(out)


def install_tree(*, dist_name: str, version: str, paths: list[str], direct_url: dict,
                 archive: Path | None = None, tree: Path | None = None, license_path: str = "LICENSE",
                 site: Path | None = None) -> Path:
    """Write ``paths`` of the archive (or checkout) into ``site`` (this Python's purelib) with a dist-info
    for ``dist_name`` ``version``. Refuses to write over a file it does not own (remove the earlier install
    first: ``pip uninstall dist_name``) and a package ``__init__.py`` of the namespace's top folder."""
    site = Path(site or sysconfig.get_paths()["purelib"])
    members = _members(archive, tree, [*paths, license_path])
    files = [(rel, data) for rel, data in members if rel != license_path]
    if not files:
        raise ValueError(f"no files under {paths} in {archive or tree}")
    # A top folder that is not itself one of ``paths`` (``megatron`` for megatron/training) is shared with
    # another distribution as a namespace package: an __init__.py there would break it.
    tops = {PurePosixPath(rel).parts[0] for rel, _ in files} - set(paths)
    for top in tops:
        if f"{top}/__init__.py" in dict(files):
            raise ValueError(f"{archive or tree} has {top}/__init__.py: {top} would stop being a namespace package")
    clash = [rel for rel, _ in files if (site / rel).exists()]
    if clash:
        raise FileExistsError(f"{len(clash)} file(s) already in {site}, e.g. {clash[0]}: not written over; "
                              f"remove the earlier install first (pip uninstall {dist_name})")
    info = f"{dist_name.replace('-', '_')}-{version}.dist-info"
    record = []
    for rel, data in files:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        record.append((rel, _b64_sha256(data), str(len(data))))
    meta = {
        "METADATA": f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n"
                    f"Summary: {', '.join(paths)} of {direct_url.get('url')}, written by {INSTALLER}\n",
        "INSTALLER": INSTALLER + "\n",
        "direct_url.json": json.dumps(direct_url, sort_keys=True) + "\n",
    }
    lic = dict(members).get(license_path)
    if lic is not None:
        meta["licenses/LICENSE"] = lic.decode("utf-8", "replace")
    (site / info / "licenses").mkdir(parents=True, exist_ok=True)
    for name, text in meta.items():
        data = text.encode()
        (site / info / name).write_bytes(data)
        record.append((f"{info}/{name}", _b64_sha256(data), str(len(data))))
    record.append((f"{info}/RECORD", "", ""))
    (site / info / "RECORD").write_text("".join(f"{a},{b},{c}\n" for a, b, c in record))
    return site / info


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python verl_patches/core/sources.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="exit 0 when the installed DIST is VERSION from the lock's release; else say why, exit 1")
    c.add_argument("dist")
    c.add_argument("version")
    c.add_argument("--archive-sha256", default="")
    c.add_argument("--commit", default="")
    i = sub.add_parser("install-tree", help="install PATHS of an archive or checkout as DIST VERSION")
    i.add_argument("dist")
    i.add_argument("version")
    i.add_argument("--paths", nargs="+", required=True)
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--archive", type=Path, help="a `git archive` tarball, checked against --archive-sha256")
    src.add_argument("--tree", type=Path, help="a checkout at --commit")
    i.add_argument("--archive-sha256", default="")
    i.add_argument("--repo", default="")
    i.add_argument("--ref", default="")
    i.add_argument("--commit", default="")
    a = p.parse_args(argv)
    if a.cmd == "check":
        try:
            installed = md.version(a.dist)
        except md.PackageNotFoundError:
            print(f"{a.dist} is not installed")
            return 1
        if installed != a.version:
            print(f"{a.dist} {installed} is installed; the lock's release reports {a.version}")
            return 1
        problem = source_problem(a.dist, a.archive_sha256 or None, a.commit or None)
        problem = problem or "; ".join(verify_record(a.dist)) or None
        if problem:
            print(problem)
            return 1
        return 0
    if a.archive is not None:
        sha = hashlib.sha256(a.archive.read_bytes()).hexdigest()
        if sha != a.archive_sha256:
            print(f"error: {a.archive} has sha256 {sha}; the lock's is {a.archive_sha256}", file=sys.stderr)
            return 2
        url = {"url": a.archive.resolve().as_uri(), "archive_info": {"hash": f"sha256={sha}", "hashes": {"sha256": sha}}}
    else:
        url = {"url": a.repo, "vcs_info": {"vcs": "git", "commit_id": a.commit, "requested_revision": a.ref}}
    try:
        where = install_tree(dist_name=a.dist, version=a.version, paths=a.paths, direct_url=url,
                             archive=a.archive, tree=a.tree)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(where)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
