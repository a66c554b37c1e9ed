"""The package version: the one place it is written (setup.py reads it without importing the package)."""

__version__ = "0.1.0"
