"""graphmesh KV store: committed KV blocks by token prefix, and KV row moves into and between executors."""
