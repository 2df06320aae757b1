"""Every difference between the torch versions k3fuse supports lives here.

k3fuse supports torch 2.11 through 2.14. Importing k3fuse on anything else raises
`UnsupportedTorchVersion` instead of failing later with an obscure tracing error.
"""
from __future__ import annotations

import re
import warnings

# torch's CPU wheel does not depend on NumPy and warns "Failed to initialize NumPy" at import when it
# is missing; k3fuse never needs NumPy, so that warning is noise for every k3fuse command. Only
# this message is hidden, and only if k3fuse is what imports torch first.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .graph_facts import COLLECTIVE_NAMESPACE  # noqa: E402

MIN_TORCH = (2, 11)
#: 2.14 checked on the CPU suite's rewrite tests (Inductor, gloo TP 2, strict counters); the next minor is unchecked
MAX_TORCH_EXCLUSIVE = (2, 15)


class UnsupportedTorchVersion(RuntimeError):
    """Raised when the installed torch is outside the supported range."""


def parse_torch_version(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedTorchVersion(f"cannot parse torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(version: str | None = None) -> tuple[int, int]:
    """Return (major, minor) of torch, raising if k3fuse does not support it."""
    version = torch.__version__ if version is None else version
    mm = parse_torch_version(version)
    if not (MIN_TORCH <= mm < MAX_TORCH_EXCLUSIVE):
        raise UnsupportedTorchVersion(
            f"k3fuse supports torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to "
            f"{MAX_TORCH_EXCLUSIVE[0]}.{MAX_TORCH_EXCLUSIVE[1] - 1}; found torch {version}"
        )
    return mm


# --- functional collectives as they appear in ATen graphs -------------------------------------
c10d_functional = getattr(torch.ops, COLLECTIVE_NAMESPACE)
ALL_REDUCE = c10d_functional.all_reduce.default
ALL_GATHER = c10d_functional.all_gather_into_tensor.default
WAIT_TENSOR = c10d_functional.wait_tensor.default
COLLECTIVE_OPS = frozenset(
    {
        ALL_REDUCE,
        ALL_GATHER,
        c10d_functional.reduce_scatter_tensor.default,
        c10d_functional.all_reduce_coalesced.default,
    }
)


def group_name_of(group: dist.ProcessGroup | None) -> str:
    """The c10d name of a process group (the string functional collectives carry in graphs)."""
    if group is None:
        group = dist.group.WORLD
    if group is None:
        raise RuntimeError("no default process group: call torch.distributed.init_process_group first")
    return group.group_name


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group behind a c10d group name; a clear error if there is none."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"k3fuse op needs process group {group_name!r} but torch.distributed is not initialized"
        )
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except Exception as exc:  # torch raises a bare ValueError/RuntimeError here
        raise RuntimeError(f"no process group named {group_name!r} in this process: {exc}") from exc


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The key-value store a process group was created with (its ranks rendezvoused there): what
    k3fuse's out-of-band agreements use, so they never pair with a collective of the group."""
    from torch.distributed import distributed_c10d as c10d

    getter = getattr(c10d, "_get_process_group_store", None)
    return getter(group) if getter is not None else c10d._world.pg_map[group][1]
