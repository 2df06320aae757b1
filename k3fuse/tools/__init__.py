"""The tools a person runs: the `k3fuse` command line (cli), demo, bench, validate and the console tables.

The compiler (the rest of k3fuse) never imports this package; tests/test_layering.py holds that.
"""
