"""The served model's names, ``GET /v1/models`` and the check of a request's ``model`` (specs/serve.md
§12.9), as vLLM has them.

Names: ``fxsched serve MODEL`` serves the name MODEL as given (``fxsched serve ./ckpt`` serves
"./ckpt", so a client's ``AutoTokenizer.from_pretrained(name)`` run where the server was started
finds the checkpoint's tokenizer); ``--served-model-name A B`` serves A and B, responses report A;
the embedded default model is ``fxsched-default``. ``/v1/models`` lists one card per name, then one
per LoRA adapter served (specs/lora.md §18.7), whose name a request's ``model`` may give too.

A request naming another model gets vLLM's 404: ``{"error": {"message": "The model `X` does not
exist.", "type": "NotFoundError", "param": "model", "code": 404}}`` (vLLM 0.11 sends ``param`` null;
here it names the field, as every other refusal of this server does). A ``model`` that is not a
string is the protocol's 400; no ``model``, null or an empty string means the first name (vLLM's
rule: its ``_is_model_supported`` takes an empty name as the served model).
"""

from __future__ import annotations

from typing import Any, Container, Optional, Sequence

from fxsched.runtime.serve.request_models import ModelNotFound

__all__ = ["ModelNotFound", "OWNER", "check_model", "model_cards"]

OWNER = "fxsched"


def check_model(data: Any, names: Sequence[str], adapters: Container[str] = ()) -> None:
    """Raise ``ModelNotFound`` when the body ``data`` names a model not in ``names`` nor a LoRA
    adapter in ``adapters``."""
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, str) and model and model not in names and model not in adapters:
        raise ModelNotFound(model)


def model_cards(names: Sequence[str], root: Optional[str], created: int, max_model_len: int,
                adapters: Sequence[Any] = (), **extra: Any) -> dict[str, Any]:
    """``GET /v1/models``: vLLM's ``ModelList`` of one card per served name (``root``: the model
    directory as given, None for the embedded model; ``parent`` null), then one per LoRA adapter
    (runtime/serve/lora.py's ``ServedAdapter``: ``root`` its directory as given, ``parent`` its
    ``base_model_name`` or the first served name, as vLLM lists them)."""
    data = [{"id": name, "object": "model", "created": created, "owned_by": OWNER, "root": root or name,
             "parent": None, "max_model_len": max_model_len, **extra} for name in names]
    data += [{"id": a.name, "object": "model", "created": created, "owned_by": OWNER, "root": a.path,
              "parent": a.base_model_name or names[0], "max_model_len": max_model_len, **extra} for a in adapters]
    return {"object": "list", "data": data}
