"""The ``--lora`` adapters of ``fxsched generate`` (specs/lora.md §18.7): ``--lora`` and
``--lora-prompts`` checked before torch is imported (``LoraChoice``), then loaded into the engine's
adapter pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fxsched.runtime.cli.usage import UsageError

BASE_ADAPTER = "base"  # --lora-prompts' name of the model without adapter


@dataclass(frozen=True)
class LoraChoice:
    """``--lora`` and ``--lora-prompts``, checked before torch: the adapters (name, directory), in pool
    slot order, the adapter of each prompt (a slot, -1: none, repeated over the requests) and the
    pool's rank (the largest ``r`` of their configs, at least 16)."""

    adapters: tuple[tuple[str, str], ...]
    slots: tuple[int, ...]
    max_rank: int


def _lora_choice(args) -> Optional[LoraChoice]:
    items = getattr(args, "lora", None) or []
    plan = getattr(args, "lora_prompts", None)
    if not items:
        if plan is not None:
            raise UsageError("--lora-prompts: needs --lora [NAME=]PATH")
        return None
    if getattr(args, "ep_ranks", 1) > 1:
        raise UsageError(f"--lora: not under expert parallelism (--ep-ranks {args.ep_ranks})")
    adapters: list[tuple[str, str]] = []
    rank = 16
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item.rstrip("/")).name or item, item
        if not name or name == BASE_ADAPTER or any(name == n for n, _ in adapters):
            raise UsageError(f"--lora {item}: the name {name!r} is " +
                             ("reserved for the base model" if name == BASE_ADAPTER else "taken or empty") +
                             " (give NAME=PATH)")
        if not Path(path).is_dir():
            raise UsageError(f"--lora {item}: " + ("not a directory" if Path(path).exists()
                                                   else "no such adapter directory"))
        try:
            r = json.loads((Path(path) / "adapter_config.json").read_text()).get("r")
            if isinstance(r, int) and not isinstance(r, bool) and r > rank:
                rank = r
        except (OSError, ValueError, AttributeError):
            pass  # the loader names what is wrong with it
        adapters.append((name, path))
    names = [n for n, _ in adapters]
    if plan is None:
        if len(adapters) > 1:
            raise UsageError(f"--lora: {len(adapters)} adapters; say which prompt runs with which with "
                             f"--lora-prompts NAME,... ({', '.join(names)} or {BASE_ADAPTER})")
        plan = names[0]
    slots = []
    for word in (w.strip() for w in plan.split(",")):
        if word != BASE_ADAPTER and word not in names:
            raise UsageError(f"--lora-prompts {plan}: {word!r} is not an adapter of --lora (choose from "
                             f"{', '.join(names)} or {BASE_ADAPTER})")
        slots.append(-1 if word == BASE_ADAPTER else names.index(word))
    return LoraChoice(tuple(adapters), tuple(slots), rank)


def _load_adapters(engine, lora: LoraChoice) -> None:
    """Load ``lora``'s adapters into the engine's pool, slot i the i-th (one line naming a bad one)."""
    from fxsched.runtime.torch_model.errors import AdapterError

    for slot, (name, path) in enumerate(lora.adapters):
        try:
            engine.load_adapter(slot, path)
        except AdapterError as err:
            raise UsageError(f"--lora {name}: {err}") from None
