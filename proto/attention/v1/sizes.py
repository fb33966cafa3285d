"""Protobuf size arithmetic for attention.v1 messages: how many bytes a field, a `Tensor` or the
`ResponseMetadata` take once serialized, computed from shapes and lengths alone (nothing is built).

The service bounds a response before any compute with it (service/doors/attention_wire.py, and the plan's
head sizing); the numbers are exact for length-delimited fields and take varints at their widest where
a value is not known yet (the timings and batch facts of the metadata).
"""

from __future__ import annotations

import functools


def varint(value: int) -> int:
    """Bytes of a non-negative varint."""
    return max(1, (value.bit_length() + 6) // 7)


def field(length: int) -> int:
    """A length-delimited field of `length` bytes: tag, length prefix, payload."""
    return 1 + varint(length) + length


def tensor(shape: tuple[int, ...], itemsize: int) -> int:
    """An attention.v1.Tensor's body: dtype (never 0 here), packed shape, data."""
    count = 1
    for d in shape:
        count *= d
    return 2 + field(sum(varint(d) for d in shape)) + field(count * itemsize)


# Shapes repeat (a few lengths, one d_model), and a size is computed for every sequence of every call.
@functools.lru_cache(maxsize=4096)
def tensor_field(shape: tuple[int, ...], itemsize: int) -> int:
    """`tensor` as a field of its parent."""
    return field(tensor(shape, itemsize))


@functools.lru_cache(maxsize=16)
def metadata_field(*texts: str) -> int:
    """The ResponseMetadata field: queue_us, compute_us (int64), batch_size, padded_length (int32 >= 0),
    fp32_retry, then the strings (the model's: the same on every call, hence the cache)."""
    return field(2 * 11 + 2 * 6 + 2 + sum(field(len(text.encode())) for text in texts))
