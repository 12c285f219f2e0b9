"""Fetch one sdist through pip's configured index, without letting pip build it.

vLLM built with VLLM_TARGET_DEVICE=empty reports version ``X+empty``; pip then discards
the sdist for a ``vllm==X`` requirement. pip still resolves the file's address through
whatever index the machine is configured with, and prints it: we take that address
(checking the sha256 pip publishes with it) and download the file ourselves.

    python scripts/fetch_sdist.py NAME VERSION OUT_FILE [SHA256]

SHA256 (from the lock) is checked when given; otherwise the hash the index publishes
with the address, if any.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

# The option rules (verl_patches/base/schema.py, standard library only) from this checkout.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_url(name: str, version: str) -> str:
    fname = f"{name}-{version}.tar.gz"
    with tempfile.TemporaryDirectory() as tmp:
        # --no-deps + an impossible build env: pip resolves and logs the link, then
        # fails while building metadata; we only need the log.
        env = dict(os.environ, VLLM_TARGET_DEVICE="empty")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-v", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", f"{name}=={version}", "-d", tmp],
            capture_output=True, text=True, env=env,
        )
    log = proc.stdout + proc.stderr
    urls = re.findall(r"(https?://\S+/" + re.escape(fname) + r"(?:#sha256=[0-9a-f]{64})?)", log)
    if not urls:
        sys.exit(f"fetch_sdist: pip did not report an address for {fname}; pip said:\n{log[-3000:]}")
    # Prefer an address that carries its hash.
    urls.sort(key=lambda u: "#sha256=" not in u)
    return urls[0]


def main(argv: list[str] | None = None) -> None:
    from verl_patches.base.schema import Text
    p = argparse.ArgumentParser(prog="fetch_sdist.py", description=__doc__.split("\n\n", 1)[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", type=Text(), help="the distribution's name, e.g. vllm")
    p.add_argument("version", type=Text(), help="its exact version, e.g. 0.9.1")
    p.add_argument("out", type=Text(), metavar="OUT_FILE", help="where the .tar.gz is written (via OUT_FILE.part)")
    p.add_argument("sha256", nargs="?", type=Text(), default=None, help="the sdist's sha256 (from the lock); checked when given")
    args = p.parse_args(argv)
    name, version, out = args.name, args.version, args.out
    url = find_url(name, version)
    base, _, frag = url.partition("#")
    want = args.sha256 or (frag.split("=", 1)[1] if frag.startswith("sha256=") else None)
    tmp = out + ".part"
    h = hashlib.sha256()
    with urllib.request.urlopen(base, timeout=300) as r, open(tmp, "wb") as f:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            f.write(chunk)
    if want and h.hexdigest() != want:
        os.unlink(tmp)
        sys.exit(f"fetch_sdist: sha256 mismatch for {base}: got {h.hexdigest()}, index says {want}")
    os.replace(tmp, out)
    print(f"fetch_sdist: {out} ({os.path.getsize(out)} bytes, sha256 {'verified' if want else 'not published'})")


if __name__ == "__main__":
    main()
