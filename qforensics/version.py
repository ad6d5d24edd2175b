"""The package version, importable without loading anything else of qforensics."""

__version__ = "0.1.0"
