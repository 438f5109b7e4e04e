"""Validate a `bench offline` result against loadtests/data/spec_benchmark.schema.json.

Uses `jsonschema` when it is installed; otherwise a small validator covering exactly the keywords the
schema uses (type, const, enum, required, properties, additionalProperties, items, minItems, minLength,
minimum, maximum, local $ref), so the check never silently disappears.

    python -m loadtests.schema RESULT.json [...]
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from loadtests.resources import data

SCHEMA_PATH = data("spec_benchmark.schema.json")

_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def _is(value: Any, type_name: str) -> bool:
    check = _TYPES[type_name]
    return check(value) if callable(check) and not isinstance(check, type) else isinstance(value, check)


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref are supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _check(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str, errors: list[str]) -> None:
    if "$ref" in schema:
        _check(value, _resolve(root, schema["$ref"]), root, path, errors)
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not one of {schema['enum']!r}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, t) for t in types):
            errors.append(f"{path}: expected {'/'.join(types)}, got {type(value).__name__}")
            return
    if _is(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        errors.append(f"{path}: shorter than {schema['minLength']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                _check(item, schema["items"], root, f"{path}[{i}]", errors)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                _check(item, props[key], root, f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(item, extra, root, f"{path}.{key}", errors)


def validate(doc: Any, use_jsonschema: bool = True) -> list[str]:
    """-> a list of error messages (empty: valid)."""
    schema = load_schema()
    errors: list[str] = []
    jsonschema = None
    if use_jsonschema:
        with contextlib.suppress(ImportError):
            import jsonschema
    if jsonschema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        errors = [f"$.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    else:
        _check(doc, schema, schema, "$", errors)
    # One rule the schema's keywords do not say: every run records its outputs, in full or as digests.
    runs = doc.get("runs") if isinstance(doc, dict) else None
    for i, run in enumerate(runs if isinstance(runs, list) else []):
        if isinstance(run, dict) and "token_ids" not in run and "token_ids_sha256" not in run:
            errors.append(f"$.runs.{i}: neither token_ids nor token_ids_sha256")
    return errors


def main(argv: list[str]) -> int:
    bad = 0
    for path in argv:
        errors = validate(json.loads(Path(path).read_text()))
        print(f"{path}: {'valid' if not errors else 'INVALID'}")
        for e in errors[:20]:
            print("  " + e)
        bad += bool(errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
