"""The ``vlite`` command-line interface (click)."""
