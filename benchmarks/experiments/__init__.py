"""Experiment scripts: each measures one thing, writes its report under --out and runs as ``python -m benchmarks.experiments.<name>``."""
