"""The per-kernel benchmarks, their helpers and the tools that turn their JSON into tables (not installed
with k3fuse). Run a script from the repository root as `python -m bench.<name>`; tests import the modules
as `bench.<name>` (pytest's `pythonpath` in pyproject.toml is the repository root)."""
