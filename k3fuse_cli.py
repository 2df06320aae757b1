"""The `k3fuse` command's entry point.

It lives outside the k3fuse package on purpose: importing it before k3fuse tells the package (it looks
for this module in sys.modules) that the command will check the K3FUSE_* settings itself, after parsing
its arguments, so that `k3fuse --help` answers whatever the environment holds, while a plain
`import k3fuse` stops at once on a bad setting.
"""
from __future__ import annotations

import sys


def main() -> int:
    from k3fuse.tools.cli import main as command

    return command()


if __name__ == "__main__":
    sys.exit(main())
