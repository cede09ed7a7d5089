"""Composition: typed step functions over the passes, the pass manager, the mutable baseline, the CLI."""
