"""graphmesh SDK: build graphs, compile and run them on executors."""

from graphmesh import errors
from graphmesh.client import ExecutorClient, RemoteExecutable
from graphmesh.graph import GraphBuilder

__all__ = ["ExecutorClient", "GraphBuilder", "RemoteExecutable", "errors"]
