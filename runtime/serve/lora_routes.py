"""vLLM's runtime LoRA routes (specs/lora.md §18.7): ``POST /v1/load_lora_adapter`` (body
``{"lora_name": ..., "lora_path": ...}``) and ``POST /v1/unload_lora_adapter`` (body
``{"lora_name": ...}``), behind the front door like every route (the API key, the body checks of
serve-security.md §14.1). Served when the server runs with ``--enable-lora`` (vLLM also needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); without it they answer 404 saying so.

Answers as vLLM's: 200 with the text ``Success: LoRA adapter 'NAME' added successfully.`` (``removed``
for an unload); a refused load 400 (a bad adapter: the loader's one line naming the file at fault;
a name already served; every ``--max-loras`` slot taken), an unload of an adapter not served 404,
of one that requests still use 400; the engine not running 503. The load itself runs on the engine
thread between two batches (runtime/serve/lora.py); the route waits for it off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from fxsched.runtime.serve.lora import AdapterRefused
from fxsched.runtime.serve.request_models import APIError, Int, _Strict, request_from_data

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's body of ``/v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str
    load_inplace: Optional[bool] = None  # vLLM's reload in place: refused (unload, then load)


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's body of ``/v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: Optional[Int] = None  # vLLM's; ignored (adapters are named)


MODELS: tuple[type[BaseModel], ...] = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)


def _openapi(model: type) -> dict[str, Any]:
    """A route's body and answers in /openapi.json: vLLM's plain-text 200, the refusals above and
    the front door's (runtime/serve/guard.py)."""
    from fxsched.runtime.serve.guard import REFUSALS, openapi_body

    extra = openapi_body(model)
    extra["responses"] = {
        "200": {"description": "vLLM's plain-text success line", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "400": {"description": "a refused adapter (the loader's line naming the file), a name already served, every "
                               "slot taken, or an adapter still in use"},
        **REFUSALS,
        "404": {"description": "LoRA adapters are not served (no --enable-lora), or no adapter of that name"},
    }
    return extra


def _refused(err: AdapterRefused, param: Optional[str] = "lora_name") -> APIError:
    out = APIError(err.status, err.message, _TYPES.get(err.status, "BadRequestError"), param)
    out.code = err.status  # type: ignore[assignment]  # vLLM's code is the status, a number
    return out


def register(app: FastAPI, engine: Any, screen: Any) -> None:
    """Add the two routes to ``app`` (``engine``: the ``ServeEngine``, ``screen``: its body screen)."""

    def _enabled() -> None:
        if not engine.adapters.enabled:
            raise APIError(404, "LoRA adapters are not served: start the server with --enable-lora (and "
                                "--max-loras N) to load them at run time", "NotFoundError", None)

    @app.post("/v1/load_lora_adapter", openapi_extra=_openapi(LoadLoRAAdapterRequest),
              response_class=PlainTextResponse)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        _enabled()
        req = await screen.plan(await request.body(), False,
                                lambda data, tok: request_from_data(LoadLoRAAdapterRequest, data))
        if req.load_inplace:
            raise APIError(400, "load_inplace: not supported (unload the adapter, then load it)",
                           "BadRequestError", "load_inplace")
        if not req.lora_path.strip():
            raise APIError(400, f"lora_path: empty (the directory of the adapter '{req.lora_name}')",
                           "BadRequestError", "lora_path")
        try:
            await asyncio.to_thread(engine.load_adapter, req.lora_name, req.lora_path)
        except AdapterRefused as err:
            raise _refused(err) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_openapi(UnloadLoRAAdapterRequest),
              response_class=PlainTextResponse)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        _enabled()
        req = await screen.plan(await request.body(), False,
                                lambda data, tok: request_from_data(UnloadLoRAAdapterRequest, data))
        try:
            await asyncio.to_thread(engine.unload_adapter, req.lora_name)
        except AdapterRefused as err:
            raise _refused(err) from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
