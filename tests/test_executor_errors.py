"""Bad requests get a clear status (code, reason, a message naming the problem) and the executor keeps serving.

After every test an autouse fixture checks that health is still SERVING and that an executable
compiled before the test still gives the same answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from safetensors.numpy import save_file

from graphmesh import ExecutorClient, GraphBuilder, RemoteExecutable, errors
from graphmesh.errors import FailedPrecondition, rpc
from graphmesh.launcher import free_port
from graphmesh.protocol import ErrorClass, ProtocolError
from graphmesh.v1 import executor_pb2, graph_pb2, tensor_pb2
from graphmesh_executor.weights import resolve_under_root
from tests.conftest import executor_args, health_status, start_process

MESSAGE_CAP = 4 << 20
PARAM_CAP = 8 << 20
X = np.arange(32, dtype=np.float32).reshape(4, 8) / 7


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("errors")
    (base / "models").mkdir()
    save_file({"w": np.ones((8, 3), np.float32), "wide": np.ones((8, 4), np.float32)}, str(base / "models" / "ok.safetensors"))
    save_file({"w": np.ones((8, 3), np.float32)}, str(base / "outside.safetensors"))
    os.symlink(base / "outside.safetensors", base / "models" / "link.safetensors")
    return base / "models"


@pytest.fixture(scope="module")
def address(root: Path) -> Iterator[str]:
    """An executor of its own, with small caps so the oversize cases stay cheap."""
    addr = f"127.0.0.1:{free_port()}"
    args = executor_args(addr, "--model-root", str(root), "--max-message-bytes", str(MESSAGE_CAP),
                         "--max-param-bytes", str(PARAM_CAP))
    with start_process(args, addr, log_path=root.parent / "executor.log", env={"OMP_NUM_THREADS": "1"}):
        yield addr


@pytest.fixture(scope="module")
def client(address: str) -> Iterator[ExecutorClient]:
    with ExecutorClient(address) as c:
        yield c


def mlp() -> graph_pb2.Graph:
    g = GraphBuilder("mlp")
    g.output(g.matmul(g.input("x", (4, 8)), g.param("w", (8, 3))))
    return g.build()


@pytest.fixture(scope="module")
def sentinel(client: ExecutorClient) -> tuple[RemoteExecutable, np.ndarray]:
    exe = client.compile(mlp(), executable_id="sentinel")
    exe.set_param("w", np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3))
    return exe, exe.run({"x": X})[0]


@pytest.fixture(autouse=True)
def still_serving(address: str, sentinel: tuple[RemoteExecutable, np.ndarray]) -> Iterator[None]:
    yield
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    exe, want = sentinel
    np.testing.assert_array_equal(exe.run({"x": X})[0], want)


def run_raw(client: ExecutorClient, tensor: tensor_pb2.Tensor, name: str = "x") -> None:
    request = executor_pb2.RunRequest(executable_id="sentinel", inputs=[tensor_pb2.NamedTensor(name=name, tensor=tensor)])
    client.call(client.stub.Run, request)


def compile_raw(client: ExecutorClient, *nodes: graph_pb2.Node, outputs: tuple[str, ...] = ("a",)) -> None:
    graph = graph_pb2.Graph(name="bad", inputs=[graph_pb2.ValueInfo(
        name="x", type=graph_pb2.TensorType(dtype=tensor_pb2.DTYPE_F32, shape=[4]))], nodes=nodes, outputs=outputs)
    client.compile(graph)


def test_bytes_not_matching_shape(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"f32\[4, 8\] needs 128 bytes, got 127") as e:
        run_raw(client, tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_F32, shape=[4, 8], data=bytes(127)))
    assert e.value.reason == "BAD_TENSOR" and "'x'" in e.value.message


def test_unknown_dtype_enum(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match="unknown dtype enum value 99") as e:
        run_raw(client, tensor_pb2.Tensor(dtype=99, shape=[4, 8], data=bytes(128)))  # type: ignore[arg-type]
    assert e.value.reason == "UNKNOWN_DTYPE"


def test_negative_shape(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"negative dimension -4") as e:
        run_raw(client, tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_F32, shape=[-4, 8], data=b""))
    assert e.value.reason == "BAD_TENSOR"


def test_overflowing_shape(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"too many elements") as e:
        run_raw(client, tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_F32, shape=[1 << 40, 1 << 40, 1 << 40], data=b""))
    assert e.value.reason == "BAD_TENSOR"
    with pytest.raises(errors.InvalidArgument, match=r"dimension 4611686018427387904 .* exceeds"):
        run_raw(client, tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_F32, shape=[1 << 62], data=b""))


def test_unknown_input_name(sentinel: tuple[RemoteExecutable, np.ndarray]) -> None:
    with pytest.raises(errors.NotFound, match=r"no input 'y'; inputs are \['x'\]") as e:
        sentinel[0].run({"y": X})
    assert e.value.reason == "UNKNOWN_INPUT"


def test_wrong_shaped_input(sentinel: tuple[RemoteExecutable, np.ndarray]) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"input 'x' must have shape \[4, 8\], got \[4, 7\]") as e:
        sentinel[0].run({"x": X[:, :7]})
    assert e.value.reason == "SHAPE_MISMATCH"


def test_unknown_param(sentinel: tuple[RemoteExecutable, np.ndarray]) -> None:
    with pytest.raises(errors.NotFound, match=r"no param 'bias'") as e:
        sentinel[0].set_param("bias", np.zeros(3, np.float32))
    assert e.value.reason == "UNKNOWN_PARAM"


def test_unknown_executable(client: ExecutorClient) -> None:
    with pytest.raises(errors.NotFound, match=r"no executable 'exe-404'") as e:
        client.executable("exe-404").run({"x": X})
    assert e.value.reason == "UNKNOWN_EXECUTABLE"
    with pytest.raises(errors.NotFound, match="exe-404"):
        client.executable("exe-404").read_handle("x")  # a streaming RPC fails the same way


def test_graph_with_cycle(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"cycle through \['a', 'b'\]") as e:
        compile_raw(client, graph_pb2.Node(name="a", op="relu", inputs=["b"]),
                    graph_pb2.Node(name="b", op="relu", inputs=["a"]))
    assert e.value.reason == "BAD_GRAPH"


def test_dangling_node_input(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"node 'a' \(relu\) reads 'ghost'.*dangling") as e:
        compile_raw(client, graph_pb2.Node(name="a", op="relu", inputs=["ghost"]))
    assert e.value.reason == "BAD_GRAPH"


def test_op_with_wrong_arity(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"node 'a' \(add\).*takes 2 inputs, got 1") as e:
        compile_raw(client, graph_pb2.Node(name="a", op="add", inputs=["x"]))
    assert e.value.reason == "BAD_GRAPH"


def test_op_with_bad_attrs(client: ExecutorClient) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"op 'softmax' has no attribute 'temperature'"):
        compile_raw(client, graph_pb2.Node(name="a", op="softmax", inputs=["x"],
                                           attrs={"temperature": graph_pb2.AttrValue(f=2.0)}))
    with pytest.raises(errors.InvalidArgument, match=r"attribute 'axis' must be int, got s"):
        compile_raw(client, graph_pb2.Node(name="a", op="softmax", inputs=["x"],
                                           attrs={"axis": graph_pb2.AttrValue(s="last")}))
    with pytest.raises(errors.InvalidArgument, match=r"unknown op 'conv9d'"):
        compile_raw(client, graph_pb2.Node(name="a", op="conv9d", inputs=["x"]))


@pytest.mark.parametrize("path", ["../outside.safetensors", "__ABSOLUTE__", "link.safetensors"])
def test_load_params_outside_model_root(client: ExecutorClient, root: Path, path: str) -> None:
    if path == "__ABSOLUTE__":
        path = str(root.parent / "outside.safetensors")
    exe = client.compile(mlp())
    with pytest.raises(errors.PermissionDenied, match=r"outside the model root") as e:
        exe.load_params(path)
    assert e.value.reason == "PATH_OUTSIDE_MODEL_ROOT" and path in e.value.message
    assert exe.finalize_params() == ["w"]  # nothing was read
    exe.release()


def test_load_params_missing_file(client: ExecutorClient) -> None:
    exe = client.compile(mlp())
    with pytest.raises(errors.NotFound, match=r"no file 'nope.safetensors'") as e:
        exe.load_params("nope.safetensors")
    assert e.value.reason == "FILE_NOT_FOUND"
    exe.release()


def test_load_params_wrong_shape_and_missing_tensor(client: ExecutorClient) -> None:
    exe = client.compile(mlp())
    with pytest.raises(errors.InvalidArgument, match=r"param 'w' is declared \[8, 3\] but 'wide' .* shape \[8, 4\]") as e:
        exe.load_params("ok.safetensors", {"w": "wide"})
    assert e.value.reason == "SHAPE_MISMATCH"
    with pytest.raises(errors.NotFound, match=r"no tensor for param\(s\) 'w' \(as 'absent'\)"):
        exe.load_params("ok.safetensors", {"w": "absent"})
    with pytest.raises(errors.InvalidArgument, match=r"not a gguf checkpoint"):
        exe.load_params("ok.safetensors", fmt="gguf")
    assert exe.load_params("ok.safetensors") == ["w"]
    np.testing.assert_array_equal(exe.run({"x": X})[0], X @ np.ones((8, 3), np.float32))
    exe.release()


def test_no_model_root_is_a_failed_precondition() -> None:
    with pytest.raises(errors.FailedPrecondition, match="--model-root") as e:
        resolve_under_root(None, "model.gguf")
    assert e.value.reason == "NO_MODEL_ROOT"


def test_message_over_the_cap(client: ExecutorClient) -> None:
    g = GraphBuilder("wide_input")
    g.output(g.sum(g.input("x", (5, 1 << 18))))  # 5 MiB, over the 4 MiB cap of this executor
    exe = client.compile(g.build())
    with pytest.raises(errors.ResourceExhausted, match=r"larger than max"):
        exe.run({"x": np.zeros((5, 1 << 18), np.float32)})
    exe.release()


def test_streamed_params_over_the_cap(client: ExecutorClient) -> None:
    g = GraphBuilder("huge_param")
    g.output(g.sum(g.param("w", (3, 1 << 20))))  # 12 MiB, over --max-param-bytes of 8 MiB
    exe = client.compile(g.build())
    with pytest.raises(errors.ResourceExhausted, match=r"--max-param-bytes of 8388608") as e:
        exe.set_param("w", np.ones((3, 1 << 20), np.float32))
    assert e.value.reason == "TOO_MANY_BYTES"
    assert exe.finalize_params() == ["w"]
    exe.release()


def test_a_handler_that_fails_after_its_caller_left_returns_without_raising() -> None:
    """A recovering coordinator cancels the steps in flight; the rank's handler then fails on the stale incarnation
    with nobody to read its status. It must return, not raise (grpc logged that as 'Exception calling
    application', a crash of the handler)."""
    class Gone:
        def is_active(self) -> bool:
            return False

        def abort_with_status(self, status: Any) -> None:
            raise AssertionError("a status for a caller that left")

    class Servicer:
        @rpc
        def ExecuteStep(self, request: Any, context: Any) -> Any:
            raise ProtocolError(ErrorClass.COMM, FailedPrecondition("incarnation 3 is stale", "STALE_INCARNATION"))

    assert Servicer().ExecuteStep(None, Gone()) is None
