"""Tests of the reference hybrid model (a package so test modules import their helpers relatively)."""
