"""The package as installed: its version is the one setup.py built it with."""

from importlib import metadata

import static_moe


def test_version_matches_the_installed_distribution():
    assert static_moe.__version__ == metadata.version("static_moe")
    assert all(part.isdigit() for part in static_moe.__version__.split(".")[:2])
