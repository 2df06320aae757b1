"""What k3fuse knows about any serving engine: its supported versions, and its errors."""
from __future__ import annotations

import importlib.metadata
import re
import sys
from dataclasses import dataclass

from ..doors import EngineError


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Engine:
    """A serving engine: its import name, the distributions it ships as, the versions supported."""

    name: str  # as users know it, e.g. "vLLM"
    module: str  # import name
    distributions: tuple[str, ...]  # pip names carrying `module`
    min_version: tuple[int, int, int]  # inclusive
    max_version: tuple[int, int, int]  # exclusive

    def supported(self) -> str:
        return f"{_dotted(self.min_version)} up to (not including) {_dotted(self.max_version)}"

    def imported(self) -> bool:
        return self.module in sys.modules

    def installed_version(self) -> str | None:
        for dist_name in self.distributions:
            try:
                return importlib.metadata.version(dist_name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def check_version(self, version: str | None = None) -> str:
        """The engine's version, raising EngineError when it is not installed or not supported."""
        version = self.installed_version() if version is None else version
        if version is None:
            raise EngineError(f"{self.name} is not installed (no distribution {' or '.join(self.distributions)})",
                              f"install {self.name} {self.supported()}")
        m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
        found = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None
        if found is None or not self.min_version <= found < self.max_version:
            raise EngineError(f"{self.name} {version} is not supported by k3fuse",
                              f"k3fuse supports {self.name} {self.supported()}")
        return version


__all__ = ["Engine", "EngineError"]
