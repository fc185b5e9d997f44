"""Field checks of the OpenAI-compatible endpoint's requests, shared by its parsers (pure).

Every failure is an `ApiError` 400 in OpenAI's error shape, ``param`` naming the field
(down to ``messages[3].tool_calls[0].function.arguments``) and ``code`` saying what kind
of failure it is (``invalid_value``, ``invalid_type``, ``missing``, ``unsupported_value``).
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError

__all__ = ["bad_param", "object_field", "required", "string_field", "type_name"]


def bad_param(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    """The 400 for the field ``param``."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def type_name(v: object) -> str:
    """The JSON name of ``v``'s type (``null``, ``boolean``, ``integer``, ...)."""
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(v), type(v).__name__)


def required(obj: dict, key: str, where: str, kind: type, kind_name: str) -> Any:
    """``obj[key]``, which must be present and of type ``kind`` (``kind_name`` in errors)."""
    v = obj.get(key)
    if not isinstance(v, kind):
        raise bad_param(f"{where}.{key}", f"is required and must be {kind_name}" if v is None else
                        f"must be {kind_name}, got {type_name(v)}", "missing" if v is None else "invalid_type")
    return v


def string_field(obj: dict, key: str, where: str) -> str:
    return required(obj, key, where, str, "a string")


def object_field(obj: dict, key: str, where: str) -> dict:
    return required(obj, key, where, dict, "an object")
