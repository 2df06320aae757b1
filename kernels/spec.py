"""`Spec`: what an op's kernels need to know about one site or one call, as one frozen value.

Each op module (kernels/ops/) subclasses it: `from_call(*args, **kw)` builds it from the op's
arguments at run time; its rule builds it from a match at compile time, with the same fields.
An implementation's one predicate (`Impl.accepts`) reads it in both places: the compile-time
coverage guard (`k3fuse.guards.kernel_covers`, once per token count the site can see) and the
call-time dispatch. Fields marked `call_only` are facts only a call knows (layout, a live process
group); a rule leaves them at their default, the value the op is built to expect.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from k3fuse.graph_facts import leading_tokens


def call_only(default: Any) -> Any:
    """A field only a call can know (contiguity, alignment, device); sites assume `default`."""
    return dataclasses.field(default=default, metadata={"call_only": True})


@dataclass(frozen=True, kw_only=True)
class Spec:
    """Base of every op's spec; `tokens` is the step's token count (the product of the leading dims)."""

    op: ClassVar[str] = ""
    tokens: int = 1

    def site_values(self) -> dict[str, Any]:
        """The fields a site fixes (not `tokens`, not call-only), in declaration order: what the
        coverage guard logs."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "tokens" and not f.metadata.get("call_only")}

    def with_tokens(self, tokens: int) -> Spec:
        return dataclasses.replace(self, tokens=tokens)


def token_count(x: Any) -> int:
    """Tokens of a decode activation tensor [..., features] (k3fuse.graph_facts.leading_tokens)."""
    return leading_tokens([int(d) for d in x.shape])


def operands_misfit(operands: dict[str, Any], contiguous: bool = True) -> str | None:
    """Why named operands are not CUDA tensors on one device (and contiguous): the first check of
    every `from_call`; None when they are."""
    names = ", ".join(operands)
    tensors = list(operands.values())
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return f"{names} must be tensors"
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return f"{names} are not CUDA tensors on one device"
    if contiguous and not all(t.is_contiguous() for t in tensors):
        return f"{names} must be contiguous"
    return None


def aligned(t: Any) -> bool:
    """Contiguous and 16-byte aligned (what the vectorised kernels load)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


__all__ = ["Spec", "call_only", "token_count", "operands_misfit", "aligned"]
