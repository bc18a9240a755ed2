"""Plain data: the only values that cross between check() here and the candidate's
process (function mode). Builtin containers and scalars are encoded by tag and rebuilt
on this side; anything else fails the submission, so no object of the candidate's (an
AlwaysEqual, a patched class) reaches check().
"""

import base64


class NotPlainData(Exception):
    """A value that is not made of builtin data types only."""


MAX_DEPTH = 100
MAX_ITEMS = 2000000
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_REBUILD = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def type_name(value):
    kind = type(value)
    try:
        name = "%s.%s" % (kind.__module__, kind.__qualname__)
    except Exception:
        name = "an unnamed type"
    return name if isinstance(name, str) else "an unnamed type"


def encode_plain(value):
    """`value` as tagged JSON, if it is built from exact builtin types only.

    Exact means `type(x) is int`, never a subclass: a subclass can override
    __eq__ (the AlwaysEqual trick) or any other method. Floats and ints travel
    as hex (exact, NaN, infinities, -0.0, and no digit limits)."""
    budget = [MAX_ITEMS]

    def encode(item, depth):
        if depth > MAX_DEPTH:
            raise NotPlainData("nested deeper than %d levels" % MAX_DEPTH)
        budget[0] -= 1
        if budget[0] < 0:
            raise NotPlainData("more than %d values" % MAX_ITEMS)
        kind = type(item)
        if item is None:
            return ["none"]
        if kind is bool:
            return ["bool", item]
        if kind is int:
            return ["int", hex(item)]
        if kind is float:
            return ["float", item.hex()]
        if kind is complex:
            return ["complex", item.real.hex(), item.imag.hex()]
        if kind is str:
            return ["str", item]
        if kind is bytes or kind is bytearray:
            return ["bytes" if kind is bytes else "bytearray", base64.b64encode(bytes(item)).decode("ascii")]
        if kind in _SEQUENCES:
            return [_SEQUENCES[kind], [encode(member, depth + 1) for member in item]]
        if kind is dict:
            return ["dict", [[encode(key, depth + 1), encode(val, depth + 1)] for key, val in item.items()]]
        raise NotPlainData("a %s object" % type_name(item))

    return encode(value, 0)


def decode_plain(data):
    """Rebuild a value from encode_plain's form, trusting nothing about `data`."""
    budget = [MAX_ITEMS]

    def text(node, index):
        if len(node) <= index or type(node[index]) is not str:
            raise NotPlainData("a malformed %s" % node[0])
        return node[index]

    def decode(node, depth):
        if depth > MAX_DEPTH:
            raise NotPlainData("nested deeper than %d levels" % MAX_DEPTH)
        budget[0] -= 1
        if budget[0] < 0:
            raise NotPlainData("more than %d values" % MAX_ITEMS)
        if type(node) is not list or not node or type(node[0]) is not str:
            raise NotPlainData("a malformed value")
        tag = node[0]
        try:
            if tag == "none" and len(node) == 1:
                return None
            if tag == "bool" and len(node) == 2 and type(node[1]) is bool:
                return node[1]
            if tag == "int" and len(node) == 2:
                return int(text(node, 1), 16)
            if tag == "float" and len(node) == 2:
                return float.fromhex(text(node, 1))
            if tag == "complex" and len(node) == 3:
                return complex(float.fromhex(text(node, 1)), float.fromhex(text(node, 2)))
            if tag == "str" and len(node) == 2:
                return text(node, 1)
            if tag in ("bytes", "bytearray") and len(node) == 2:
                raw = base64.b64decode(text(node, 1).encode("ascii"), validate=True)
                return raw if tag == "bytes" else bytearray(raw)
            if tag in _REBUILD and len(node) == 2 and type(node[1]) is list:
                return _REBUILD[tag](decode(member, depth + 1) for member in node[1])
            if tag == "dict" and len(node) == 2 and type(node[1]) is list:
                result = {}
                for pair in node[1]:
                    if type(pair) is not list or len(pair) != 2:
                        raise NotPlainData("a malformed dict")
                    result[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
                return result
        except (ValueError, TypeError, OverflowError, UnicodeError) as exc:
            raise NotPlainData("a malformed %s (%s)" % (tag, type(exc).__name__))
        raise NotPlainData("a malformed or unknown value %r" % tag[:40])

    return decode(data, 0)
