"""TEI's own contracts for the tests (tests/data/tei/: its OpenAPI document and proto, version 1.9.3), and a
tei.v1 client made from TEI's proto as TEI's clients make theirs: the .proto compiled by protoc, its message
classes built from the descriptors in a pool of its own (our proto/tei/v1/tei.proto holds the same names in
the default pool), one callable per RPC at `/<service>/<method>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

DATA = Path(__file__).resolve().parents[1] / "data" / "tei"
OPENAPI = DATA / "openapi.json"
PROTO = DATA / "tei.proto"


def tei_descriptors(out: Path) -> descriptor_pb2.FileDescriptorProto:
    """TEI's proto compiled by protoc (grpc_tools) into a FileDescriptorProto."""
    from grpc_tools import protoc

    target = out / "tei.pb"
    code = protoc.main(["protoc", f"-I{DATA}", f"--descriptor_set_out={target}", "tei.proto"])
    assert code == 0, f"protoc failed on {PROTO}"
    files = descriptor_pb2.FileDescriptorSet.FromString(target.read_bytes())
    assert len(files.file) == 1
    return files.file[0]


class TeiClient:
    """A client of TEI's tei.v1 services over `channel`, from TEI's own proto: `client.messages["EmbedRequest"]`
    is the message class, `client.call("Embed", "Embed")` the RPC's callable (unary or streaming, as the proto
    says)."""

    def __init__(self, channel: grpc.aio.Channel, proto: descriptor_pb2.FileDescriptorProto) -> None:
        pool = descriptor_pool.DescriptorPool()
        pool.AddSerializedFile(proto.SerializeToString())
        self.file = pool.FindFileByName(proto.name)
        self.messages: dict[str, Any] = {name: message_factory.GetMessageClass(d)
                                         for name, d in self.file.message_types_by_name.items()}
        self.enums = {name: d for name, d in self.file.enum_types_by_name.items()}
        self._calls: dict[tuple[str, str], Any] = {}
        for service in self.file.services_by_name.values():
            for method in service.methods:
                request = message_factory.GetMessageClass(method.input_type)
                response = message_factory.GetMessageClass(method.output_type)
                kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                        (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
                    (method.client_streaming, method.server_streaming)]
                self._calls[(service.name, method.name)] = kind(
                    f"/{service.full_name}/{method.name}", request_serializer=request.SerializeToString,
                    response_deserializer=response.FromString)

    def call(self, service: str, method: str) -> Any:
        return self._calls[(service, method)]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.messages[name]
        except KeyError:
            raise AttributeError(name) from None
