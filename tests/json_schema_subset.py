"""A validator for the subset of JSON Schema (2020-12) that docs/*.schema.json use, in plain Python.

Keywords: type, enum, const, properties, required, additionalProperties (bool or schema), items,
minItems, minimum, anyOf, oneOf, $ref ("#/$defs/NAME"); $schema, title, description are annotations. Any
other keyword raises (so a schema cannot quietly use one this file does not check).
"""

from __future__ import annotations

ANNOTATIONS = {"$schema", "$defs", "title", "description"}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def errors(value, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema`` (``root``: the document ``$ref`` resolves in), as 'PATH: why'."""
    root = schema if root is None else root
    unknown = set(schema) - ANNOTATIONS - set(CHECKS)
    if unknown:
        raise ValueError(f"schema at {path} uses keywords this validator does not check: {sorted(unknown)}")
    found = []
    for keyword, check in CHECKS.items():
        if keyword in schema:
            found += check(value, schema, root, path)
    return found


def _type(value, schema, root, path):
    names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return [] if any(TYPES[n](value) for n in names) else [f"{path}: {value!r} is not of type {names}"]


def _enum(value, schema, root, path):
    return [] if any(value == v and type(value) is type(v) for v in schema["enum"]) else \
        [f"{path}: {value!r} is not one of {schema['enum']}"]


def _const(value, schema, root, path):
    want = schema["const"]
    return [] if value == want and type(value) is type(want) else [f"{path}: {value!r} is not {want!r}"]


def _properties(value, schema, root, path):
    if not isinstance(value, dict):
        return []
    return [e for k, sub in schema["properties"].items() if k in value
            for e in errors(value[k], sub, root, f"{path}.{k}")]


def _required(value, schema, root, path):
    if not isinstance(value, dict):
        return []
    return [f"{path}: missing key {k!r}" for k in schema["required"] if k not in value]


def _additional(value, schema, root, path):
    if not isinstance(value, dict):
        return []
    extra = [k for k in value if k not in schema.get("properties", {})]
    rule = schema["additionalProperties"]
    if rule is True:
        return []
    if rule is False:
        return [f"{path}: unexpected key {k!r}" for k in extra]
    return [e for k in extra for e in errors(value[k], rule, root, f"{path}.{k}")]


def _items(value, schema, root, path):
    if not isinstance(value, list):
        return []
    return [e for i, item in enumerate(value) for e in errors(item, schema["items"], root, f"{path}[{i}]")]


def _min_items(value, schema, root, path):
    if isinstance(value, list) and len(value) < schema["minItems"]:
        return [f"{path}: {len(value)} items, fewer than {schema['minItems']}"]
    return []


def _minimum(value, schema, root, path):
    if TYPES["number"](value) and value < schema["minimum"]:
        return [f"{path}: {value!r} is below {schema['minimum']}"]
    return []


def _any_of(value, schema, root, path):
    branches = [errors(value, sub, root, path) for sub in schema["anyOf"]]
    if any(not b for b in branches):
        return []
    return [f"{path}: matches none of anyOf: " + " | ".join("; ".join(b) for b in branches)]


def _one_of(value, schema, root, path):
    branches = [errors(value, sub, root, path) for sub in schema["oneOf"]]
    matched = sum(not b for b in branches)
    return [] if matched == 1 else [f"{path}: matches {matched} of oneOf's {len(branches)} branches, not exactly 1"]


def _ref(value, schema, root, path):
    prefix = "#/$defs/"
    if not schema["$ref"].startswith(prefix):
        raise ValueError(f"unsupported $ref {schema['$ref']!r}")
    return errors(value, root["$defs"][schema["$ref"][len(prefix):]], root, path)


CHECKS = {
    "type": _type, "enum": _enum, "const": _const, "properties": _properties, "required": _required,
    "additionalProperties": _additional, "items": _items, "minItems": _min_items, "minimum": _minimum,
    "anyOf": _any_of, "oneOf": _one_of, "$ref": _ref,
}
