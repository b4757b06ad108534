"""The browser playground: `/` serves a chat page and `/static/...` its files, shipped inside the package."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


def add_playground_routes(app: FastAPI) -> None:
    """`/` (no API key needed: the page asks for one when /v1 answers 401) and `/static/<file>`."""
    index = STATIC_DIR / "index.html"
    if not index.is_file():
        raise ValueError(f"the playground files are missing from the installed package: {index}")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        # no-cache: a browser revalidates, so an upgraded server never pairs new JS with an old page.
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
