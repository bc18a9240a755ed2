"""Reads NumPy's `.npy` format (as vLLM sends `routed_experts`) without NumPy.

The server does not depend on NumPy; a `.npy` array of integers is a short
header (magic, version, a Python-literal dict with descr, fortran_order and
shape) and the raw values, which `struct` reads. Only what vLLM writes is
accepted: little-endian or byte-sized integers, C order.
"""

from __future__ import annotations

import ast
import base64
import math
import struct

MAGIC = b"\x93NUMPY"
FORMATS = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "u8": "Q", "i8": "q"}


def decode_npy(data: bytes) -> tuple[tuple[int, ...], list[int]]:
    """(shape, values in C order) of an integer `.npy` array; ValueError for anything else."""
    if not data.startswith(MAGIC) or len(data) < 10:
        raise ValueError("not a .npy array")
    major = data[6]
    if major == 1:
        (header_len,) = struct.unpack_from("<H", data, 8)
        start = 10
    elif major in (2, 3):
        (header_len,) = struct.unpack_from("<I", data, 8)
        start = 12
    else:
        raise ValueError(f".npy version {major} is not known")
    header = ast.literal_eval(data[start : start + header_len].decode("latin-1"))
    if not isinstance(header, dict) or header.get("fortran_order"):
        raise ValueError(".npy array is not in C order")
    descr = str(header.get("descr", ""))
    order, kind = descr[:1], descr[1:]
    if kind not in FORMATS or order not in ("<", "|") or (order == "|" and kind[1] != "1"):
        raise ValueError(f".npy dtype {descr!r} is not a little-endian integer")
    shape = tuple(int(n) for n in header.get("shape", ()))
    count = math.prod(shape)
    body = data[start + header_len :]
    size = struct.calcsize("<" + FORMATS[kind])
    if len(body) < count * size:
        raise ValueError(f".npy body has {len(body)} bytes, {count * size} needed for shape {shape}")
    return shape, list(struct.unpack_from(f"<{count}{FORMATS[kind]}", body))


def decode_npy_base64(text: str) -> tuple[tuple[int, ...], list[int]]:
    return decode_npy(base64.b64decode(text, validate=True))
