"""The LoRA adapters a ``fxsched serve`` engine serves by name (runtime/serve/lora.py, specs/lora.md
§18.7): ``EngineAdapters``, the methods of ``ServeEngine`` (runtime/serve/engine.py) that load and
unload them (from any thread, carried out on the engine thread) and place a request's adapter in a
pool slot on demand (on the engine thread).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import structlog

from fxsched.runtime.serve.lora import AdapterBook, AdapterOp, AdapterRefused, ServedAdapter
from fxsched.runtime.torch_model import HybridEngine

log = structlog.get_logger("fxsched.serve.engine")  # the engine's own log (runtime/serve/engine.py)

ADAPTER_OP_TIMEOUT = 60.0  # seconds a LoRA load or unload may wait for the engine thread


class EngineAdapters:
    """The LoRA adapter methods of ``ServeEngine`` (runtime/serve/engine.py), which provides the rest."""

    if TYPE_CHECKING:  # ServeEngine's
        engine: HybridEngine
        adapters: AdapterBook
        _thread: Optional[threading.Thread]
        _inbox: queue.SimpleQueue[Any]
        _retry_ops: list[AdapterOp]

        @property
        def alive(self) -> bool: ...

        def _refresh(self) -> None: ...

    def load_adapter(self, name: str, path: str, base_model_name: Optional[str] = None,
                     timeout: float = ADAPTER_OP_TIMEOUT) -> ServedAdapter:
        """Load the PEFT adapter in ``path`` into a free pool slot and serve it as ``name`` (any thread;
        blocks until the engine thread has loaded it). ``AdapterRefused`` names the adapter and why."""
        adapter = self.adapters.reserve(name, path, base_model_name)
        op = self._adapter_op(AdapterOp("load", adapter), timeout)
        if op.error is not None:
            raise AdapterRefused(400, f"The lora adapter '{name}' cannot be loaded: {op.error}", name, op.error)
        return adapter

    def unload_adapter(self, name: str, timeout: float = ADAPTER_OP_TIMEOUT) -> ServedAdapter:
        """Stop serving adapter ``name`` and empty its slot (refused while requests use it)."""
        adapter = self.adapters.begin_unload(name)
        op = self._adapter_op(AdapterOp("unload", adapter), timeout)
        if op.error is not None:
            raise AdapterRefused(500, f"The lora adapter '{name}' could not be unloaded: {op.error}")
        return adapter

    def _adapter_op(self, op: AdapterOp, timeout: float) -> AdapterOp:
        """Run ``op`` at once (before the engine thread starts), else on the engine thread."""
        if self._thread is None:
            op.run(self.engine, self.adapters)
            if op.retry:  # no sequence runs before the engine starts
                op.error = "a sequence still runs with its adapter"
            return op
        self._inbox.put(op)
        deadline = time.monotonic() + timeout
        while not op.done.wait(0.05):
            if not self.alive or time.monotonic() > deadline:
                if op.kind == "load":
                    self.adapters.abort(op.adapter)
                raise AdapterRefused(503, f"The lora adapter '{op.adapter.name}': the engine did not carry out "
                                          f"the {op.kind} (it is not running, or busy past {timeout:g} s)")
        return op

    def _adapter_ops(self, items: list[Any]) -> list[Any]:
        """Carry out the adapter ops among the inbox's ``items`` (engine thread); the other items."""
        ops = [item for item in items if isinstance(item, AdapterOp)]
        if not ops:
            return items
        for op in ops:
            op.run(self.engine, self.adapters)
            if op.retry:
                self._retry_ops.append(op)
        self._refresh()
        return [item for item in items if not isinstance(item, AdapterOp)]

    def _place(self, name: str) -> Union[int, str, None]:
        """The pool slot adapter ``name`` runs in, loading it on demand (engine thread; see
        runtime/serve/lora.py): a free slot, else the least recently used idle adapter's (evicted);
        None when every slot's adapter has requests in flight; a string: why it cannot be loaded."""
        from fxsched.runtime.torch_model.errors import AdapterError, SlotError

        book = self.adapters
        slot = book.slot_for(name)
        if slot is not None:
            return slot
        adapter = book.get(name)
        if adapter is None:  # cannot happen while the choice holds it (unloads of adapters in use are refused)
            return f"The lora adapter '{name}' is no longer served"
        slot = book.free_slot()
        if slot is None:
            for victim, victim_slot in book.idle():
                try:
                    self.engine.unload_adapter(victim_slot)
                except SlotError:  # a finished request's sequence not yet freed: another, or later
                    continue
                book.evicted(victim)
                log.info("lora_evicted", name=victim, slot=victim_slot, for_adapter=name)
                slot = victim_slot
                break
            else:
                return None
        try:
            self.engine.load_adapter(slot, Path(adapter.path))
        except AdapterError as err:  # its files changed since it was listed
            return f"The lora adapter '{name}' cannot be loaded: {err}"
        book.placed(name, slot)
        log.info("lora_loaded", name=name, slot=slot, path=adapter.path, on_demand=True)
        return slot

    def _retry_adapter_ops(self) -> None:
        """Unloads that found a finished request's sequence still bound, tried again."""
        if self._retry_ops:
            ops, self._retry_ops = self._retry_ops, []
            self._adapter_ops(list(ops))
