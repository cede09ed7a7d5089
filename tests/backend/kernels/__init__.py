"""Kernel tests (a package so test modules import their helpers relatively)."""
