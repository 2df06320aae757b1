"""Fixtures shared by the test modules (nothing here is autouse: a module asks for what it needs)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def with_weight_prefetch():
    """weight_prefetch is off by default (measured slower in the layer, docs/perf.md); modules whose
    tests cover its rewrites too name it (the ranks inherit the environment). Use it module-wide
    with `pytestmark = pytest.mark.usefixtures("with_weight_prefetch")`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3FUSE_RULES", "+weight_prefetch")
        yield


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The CLI tests' small exported programs (cli_helpers.save_programs), saved once per module."""
    from cli_helpers import save_programs

    return save_programs(tmp_path_factory.mktemp("programs"))
