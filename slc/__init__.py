"""The `slc` command line: the one place that knows every package (see cli.py)."""
