"""An ONNX file's graph without its weights, read straight from the protobuf wire format.

Protobuf has no lazy fields: parsing a model whose weights sit inside the .onnx
file holds the file's bytes and the parsed message at once (2x the model).
`skeleton` walks the file's wire format through a memory map instead and
returns the model with every large initializer turned into an external-data
reference into the .onnx file itself (offset and length of its raw_data), so
ONNX Runtime and `graph_ops.FileWeights` read the weights from the file when
they need them and this process never holds a copy. Only the tensor payloads
are skipped; every other byte is parsed by protobuf as usual.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import onnx

MODEL_GRAPH = 7
GRAPH_INITIALIZER = 5
TENSOR_RAW_DATA = 9
LENGTH_DELIMITED = 2


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, start of the key, start of the value, end of the value) of each field."""
    pos = start
    while pos < end:
        key_start = pos
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _varint(buf, pos)
        elif wire == 1:
            after = pos + 8
        elif wire == 5:
            after = pos + 4
        elif wire == LENGTH_DELIMITED:
            length, pos = _varint(buf, pos)
            after = pos + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} at byte {key_start}")
        if after > end:
            raise ValueError(f"field {field} at byte {key_start} runs past the end of its message")
        yield field, wire, key_start, pos, after
        pos = after


def _message(field: int, payload: bytes) -> bytes:
    return _encode_varint(field << 3 | LENGTH_DELIMITED) + _encode_varint(len(payload)) + payload


def _tensor(buf, start: int, end: int, location: str, keep_below: int) -> bytes | None:
    """The initializer as a reference to its raw_data in the file, or None to keep it as it is."""
    raw = None
    rest = bytearray()
    for field, wire, key_start, value_start, value_end in _fields(buf, start, end):
        if field == TENSOR_RAW_DATA and wire == LENGTH_DELIMITED:
            raw = (value_start, value_end - value_start)
        else:
            rest += buf[key_start:value_end]
    if raw is None or raw[1] < keep_below:
        return None
    tensor = onnx.TensorProto()
    tensor.ParseFromString(bytes(rest))
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(raw[0])), ("length", str(raw[1]))):
        tensor.external_data.add(key=key, value=value)
    return tensor.SerializeToString()


def skeleton(path: str | Path, keep_below: int = 1024) -> onnx.ModelProto:
    """The model at `path` with every top-level initializer of `keep_below` bytes or more pointing into
    the file itself (external data, location = the file's name) instead of holding its weights."""
    path = Path(path)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        out = bytearray()
        for field, wire, key_start, value_start, value_end in _fields(buf, 0, len(buf)):
            if field != MODEL_GRAPH or wire != LENGTH_DELIMITED:
                out += buf[key_start:value_end]
                continue
            graph = bytearray()
            for g_field, g_wire, g_key, g_start, g_end in _fields(buf, value_start, value_end):
                light = (
                    _tensor(buf, g_start, g_end, path.name, keep_below)
                    if g_field == GRAPH_INITIALIZER and g_wire == LENGTH_DELIMITED
                    else None
                )
                graph += buf[g_key:g_end] if light is None else _message(GRAPH_INITIALIZER, light)
            out += _message(MODEL_GRAPH, bytes(graph))
    model = onnx.ModelProto()
    model.ParseFromString(bytes(out))
    return model
