"""SHA-256 of a file, read in chunks so that a large corpus or checkpoint never sits in memory
whole: what snapshots, corpora, prepared token files and exports record of their inputs."""

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
