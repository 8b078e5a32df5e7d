"""Breaking-change check of the wire contracts: compares proto/ with the descriptors of the last release
(`proto/released.txtpb`, a FileDescriptorSet in text format, so a release shows as a readable diff).

Rules (buf's WIRE_JSON category, which keeps both the binary and the JSON encoding readable by old peers):
no package, message, enum, service or RPC removed; no field or enum value removed unless its number and
name are reserved; a field number keeps its name, JSON name, type, label, presence and oneof; an enum
number keeps its name; an RPC keeps its request and response types and its streaming. Messages, enums and
types are matched by full name, so moving one between files of a package is not a change; anything added
is allowed.

    python -m services.common.proto_breaking          # prints the breaking changes, exits 1 if any
    python -m services.common.proto_breaking release  # a deliberate release: rewrite the snapshot"""

from __future__ import annotations

import pathlib
import sys
import tempfile
from collections.abc import Iterator

from google.protobuf import descriptor_pb2, text_format

from services.common.protogen import PROTO_DIR

SNAPSHOT = PROTO_DIR / "released.txtpb"
FieldProto = descriptor_pb2.FieldDescriptorProto


def build(proto_dir: pathlib.Path = PROTO_DIR) -> descriptor_pb2.FileDescriptorSet:
    """The descriptors of every .proto under `proto_dir` (imports outside it, such as google/protobuf, are
    referenced by name and not included)."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "set.binpb"
        if protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", f"--descriptor_set_out={out}", *protos]) != 0:
            raise SystemExit(f"protoc failed on {proto_dir}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def load(path: pathlib.Path = SNAPSHOT) -> descriptor_pb2.FileDescriptorSet:
    return text_format.Parse(path.read_text(), descriptor_pb2.FileDescriptorSet())


def write(descriptors: descriptor_pb2.FileDescriptorSet, path: pathlib.Path = SNAPSHOT) -> None:
    header = "# Descriptors of the released protos; python -m services.common.proto_breaking release rewrites it.\n"
    path.write_text(header + text_format.MessageToString(descriptors))


class _Index:
    """Every package, message, enum and service of a descriptor set by full name."""

    def __init__(self, descriptors: descriptor_pb2.FileDescriptorSet):
        self.packages: set[str] = set()
        self.files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
        self.services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
        for file in descriptors.file:
            self.files[file.name] = file
            self.packages.add(file.package)
            prefix = f"{file.package}." if file.package else ""
            self._add(prefix, file.message_type, file.enum_type)
            for service in file.service:
                self.services[prefix + service.name] = service

    def _add(self, prefix: str, messages, enums) -> None:
        for enum in enums:
            self.enums[prefix + enum.name] = enum
        for message in messages:
            self.messages[prefix + message.name] = message
            self._add(f"{prefix}{message.name}.", message.nested_type, message.enum_type)


def _reserved(ranges, number: int) -> bool:
    return any(r.start <= number < r.end for r in ranges)


def _enum_reserved(ranges, number: int) -> bool:
    return any(r.start <= number <= r.end for r in ranges)  # enum reserved ranges are inclusive


def _field_type(field: FieldProto) -> str:
    if field.type in (FieldProto.TYPE_MESSAGE, FieldProto.TYPE_ENUM, FieldProto.TYPE_GROUP):
        return field.type_name.lstrip(".")
    return FieldProto.Type.Name(field.type).removeprefix("TYPE_").lower()


def _label(field: FieldProto) -> str:
    """repeated, required, optional (explicit presence: `has_` in generated code) or singular."""
    if field.label != FieldProto.LABEL_OPTIONAL:
        return FieldProto.Label.Name(field.label).removeprefix("LABEL_").lower()
    return "optional" if field.proto3_optional else "singular"


def _oneof(message: descriptor_pb2.DescriptorProto, field: FieldProto) -> str:
    if not field.HasField("oneof_index") or field.proto3_optional:  # proto3 optional is a synthetic oneof
        return ""
    return message.oneof_decl[field.oneof_index].name


def _messages(name: str, old: descriptor_pb2.DescriptorProto, new: descriptor_pb2.DescriptorProto) -> Iterator[str]:
    new_fields = {f.number: f for f in new.field}
    for before in old.field:
        where = f"field {name}.{before.name} (number {before.number})"
        after = new_fields.get(before.number)
        if after is None:
            if not (_reserved(new.reserved_range, before.number) and before.name in new.reserved_name):
                moved = next((f.number for f in new.field if f.name == before.name), None)
                yield (
                    f"{where} renumbered to {moved}"
                    if moved is not None
                    else f"{where} deleted without reserving its number and name"
                )
            continue
        if after.name != before.name:
            yield f"{where} renamed to {after.name}"
        elif after.json_name != before.json_name:
            yield f"{where} changed its JSON name from {before.json_name} to {after.json_name}"
        if _field_type(after) != _field_type(before):
            yield f"{where} changed type from {_field_type(before)} to {_field_type(after)}"
        if _label(after) != _label(before):
            yield f"{where} changed from {_label(before)} to {_label(after)}"
        if _oneof(new, after) != _oneof(old, before):
            yield f"{where} moved from oneof '{_oneof(old, before)}' to '{_oneof(new, after)}'"


def _enums(
    name: str, old: descriptor_pb2.EnumDescriptorProto, new: descriptor_pb2.EnumDescriptorProto
) -> Iterator[str]:
    new_values = {v.number: v for v in new.value}
    for before in old.value:
        after = new_values.get(before.number)
        where = f"enum value {name}.{before.name} (number {before.number})"
        if after is None:
            if not (_enum_reserved(new.reserved_range, before.number) and before.name in new.reserved_name):
                yield f"{where} deleted without reserving its number and name"
        elif after.name != before.name:
            yield f"{where} renamed to {after.name}"


def _services(
    name: str, old: descriptor_pb2.ServiceDescriptorProto, new: descriptor_pb2.ServiceDescriptorProto
) -> Iterator[str]:
    new_methods = {m.name: m for m in new.method}
    for before in old.method:
        after = new_methods.get(before.name)
        where = f"rpc {name}.{before.name}"
        if after is None:
            yield f"{where} deleted"
            continue
        for part, was, now in (
            ("request", before.input_type, after.input_type),
            ("response", before.output_type, after.output_type),
        ):
            if was != now:
                yield f"{where} changed its {part} type from {was.lstrip('.')} to {now.lstrip('.')}"
        for side, was, now in (
            ("client", before.client_streaming, after.client_streaming),
            ("server", before.server_streaming, after.server_streaming),
        ):
            if was != now:
                yield f"{where} {'became' if now else 'stopped being'} {side}-streaming"


def breaking_changes(old: descriptor_pb2.FileDescriptorSet, new: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """One line per change of `new` that a peer built from `old` could not read or call; [] if none."""
    before, after = _Index(old), _Index(new)
    found = [f"package {p} deleted" for p in sorted(before.packages - after.packages)]
    for path, file in sorted(before.files.items()):
        if path in after.files:
            moved = after.files[path]
            if moved.package != file.package:
                found.append(f"file {path} changed package from {file.package} to {moved.package}")
            if (moved.syntax or "proto2") != (file.syntax or "proto2"):
                found.append(f"file {path} changed syntax from {file.syntax or 'proto2'} to {moved.syntax or 'proto2'}")
    for kind, olds, news, compare in (
        ("message", before.messages, after.messages, _messages),
        ("enum", before.enums, after.enums, _enums),
        ("service", before.services, after.services, _services),
    ):
        for name, old_def in sorted(olds.items()):
            if name not in news:
                found.append(f"{kind} {name} deleted")
            else:
                found.extend(compare(name, old_def, news[name]))
    return found


def main(argv: list[str]) -> int:
    current = build()
    if argv[:1] == ["release"]:
        write(current)
        print(f"wrote {SNAPSHOT.relative_to(PROTO_DIR.parent)} ({len(current.file)} files)", file=sys.stderr)
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    found = breaking_changes(load(), current)
    for line in found:
        print(f"breaking: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
