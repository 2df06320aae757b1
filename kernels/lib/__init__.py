"""The kernel library: kernel bodies and their launch code, by toolchain (cute/, triton/) plus the
plain-torch references and stock sequences (reference/), and launch sequences across toolchains
(composite/).

It registers nothing: the op modules (k3fuse.kernels.ops) decide when a kernel runs (their Impl
predicates) and call into here. A toolchain package never imports the other one; only composite/ imports
both.
"""
