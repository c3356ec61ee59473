"""OpenAPI for the control API, generated from the same msgspec structs that decode bodies,
so the published schema cannot drift from what the server accepts and answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

REF = "#/components/schemas/{name}"


def ref(struct: type[msgspec.Struct]) -> dict[str, str]:
    """A JSON-schema reference to ``struct``'s component."""
    return {"$ref": REF.format(name=struct.__name__)}


def json_body(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """``openapi_extra`` declaring a required JSON request body of ``struct``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref(struct)}},
        }
    }


Body = type[msgspec.Struct] | Mapping[str, type[msgspec.Struct]]
"""A JSON body's struct, or ``{media type: struct}`` for an answer with several."""


def responses(answers: Mapping[int, tuple[str, Body]]) -> dict[int | str, Any]:
    """FastAPI ``responses=`` from ``{status: (description, struct or {media: struct})}``."""
    out: dict[int | str, Any] = {}
    for status, (description, body) in answers.items():
        media = body if isinstance(body, Mapping) else {"application/json": body}
        out[status] = {
            "description": description,
            "content": {kind: {"schema": ref(struct)} for kind, struct in media.items()},
        }
    return out


def install_schema(app: FastAPI, structs: Iterable[type[msgspec.Struct]]) -> None:
    """Make ``app.openapi()`` include the msgspec components every route refers to."""
    _, components = msgspec.json.schema_components(tuple(structs), ref_template=REF)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    generator: Callable[[], dict[str, Any]] = openapi
    app.openapi = generator  # type: ignore[method-assign]
