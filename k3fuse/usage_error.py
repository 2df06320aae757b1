"""User mistakes: `UsageError` names the problem and the fix; the CLI prints it as one line.

Kept free of torch so that every verb (and `k3fuse --help`) can import it cheaply.
"""
from __future__ import annotations


class UsageError(Exception):
    """A mistake the user can fix (bad argument, missing file...), not a bug in k3fuse.

    `k3fuse` prints `k3fuse <verb>: error: <problem>; <fix>` on one line and exits with status 2;
    the traceback only appears with `--debug`.
    """

    exit_status = 2

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


__all__ = ["UsageError"]
