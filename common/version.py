"""The installed depthdiag version, for the provenance files record."""

from importlib import metadata


def package_version() -> str:
    """depthdiag's version as installed, or 'unknown' when it runs from a source tree only."""
    try:
        return metadata.version("depthdiag")
    except metadata.PackageNotFoundError:
        return "unknown"
