"""What the three services share to serve and nothing a client imports: a server built from its security flags
(bootstrap), grpc.aio serving, the security interceptors and the method policy, telemetry and JSON logs, etcd and
executor membership, and the fault injection tests and benchmarks use. The SDK (`graphmesh`) never imports it."""
