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

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import urllib.request


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


def main() -> None:
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    name, version, out = sys.argv[1:4]
    url = find_url(name, version)
    base, _, frag = url.partition("#")
    want = sys.argv[4] if len(sys.argv) == 5 else (frag.split("=", 1)[1] if frag.startswith("sha256=") else None)
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
