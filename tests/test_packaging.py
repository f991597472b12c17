"""Client and server apart: the SDK (`graphmesh`) holds what a client imports, and the serving machinery the services
share lives in `graphmesh_server` (services/common). A client installs the SDK alone, so no SDK module may need it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import requires

# Run in a fresh interpreter: graphmesh_server refused by the import system, every SDK module imported, and none of
# them may have pulled graphmesh_server in (a lazy import would only fail later, in a client's hands).
_IMPORT_SDK = """
import importlib, importlib.abc, pkgutil, sys

class NoServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "graphmesh_server" or name.startswith("graphmesh_server."):
            raise ImportError(f"the SDK imported {name}")
        return None

sys.meta_path.insert(0, NoServer())
import graphmesh
names = [m.name for m in pkgutil.walk_packages(graphmesh.__path__, "graphmesh.")]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.startswith("graphmesh_server")]
print(len(names))
"""


def test_every_sdk_module_imports_without_the_server_package() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_SDK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 20  # the walk found the SDK's modules (client, channels, cli, launcher, models, ...)


def test_the_sdk_distribution_does_not_depend_on_the_server_one_and_every_service_does() -> None:
    assert not [r for r in requires("graphmesh") or [] if r.startswith("graphmesh")]
    for service in ("graphmesh-coordinator", "graphmesh-executor", "graphmesh-kvstore"):
        assert "graphmesh-server" in (requires(service) or []), service
