"""LoRA adapters served by name (specs/lora.md §18.7): the book of resident adapters, the requests in
flight per adapter, and the loads and unloads the engine thread carries out.

Every served adapter is resident: it holds one of the engine's ``--max-loras`` pool slots from the
moment it is listed until it is unloaded, and a request naming it runs with that slot
(``Request.adapter_slot``) from its admission on. Nothing is loaded on demand (no rotation, which
would stall serving until the engine is quiescent), so more adapters than slots is a refusal: at
start (``--lora-modules``), or a 400 from ``/v1/load_lora_adapter``.

Threads. ``AdapterBook`` is read and written under its own lock by the HTTP side (names, submit,
the load and unload routes) and by the engine thread (a choice's end). The pool itself (the engine's
``LoraPool``) is touched only by the engine thread: a load or an unload is an ``AdapterOp`` put on
the engine's inbox and carried out between two batches (``AdapterOp.run``); its caller waits for
its ``done`` event. Before the engine thread starts (the adapters of the command line) the op runs
at once on the caller's thread.

Unloading an adapter that requests still use (submitted, not finished: queued, running or spilled)
is refused with a 400 naming it and the count; from the moment an unload is accepted, requests
naming the adapter get the 404 of an unknown model. A request that names an adapter holds it from
``submit`` on, so an accepted unload can never leave a request without its adapter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import structlog

log = structlog.get_logger("fxsched.serve.lora")


class AdapterRefused(Exception):
    """A load or unload the book refuses: ``status`` 400 or 404, ``message`` names the adapter."""

    def __init__(self, status: int, message: str, name: str = "", detail: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.name = name  # the adapter's
        self.detail = detail  # the loader's one line (a refused load)


def _refused(name: str, status: int, message: str) -> AdapterRefused:
    return AdapterRefused(status, message, name)


class AdapterGone(Exception):
    """A request names an adapter that is no longer served (unloaded since its name was checked)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter the server serves: its name, its directory as given (``/v1/models``' ``root``),
    its pool slot and the base model name it reports as ``parent`` (None: the served model's)."""

    name: str
    path: str
    slot: int
    base_model_name: Optional[str] = None


@dataclass
class _Use:
    waiting: int = 0  # submitted, not yet scheduled
    running: int = 0  # scheduled (prefilling, decoding, preempted or spilled), not finished


class AdapterBook:
    """The served adapters by name, the slots reserved for loads in progress and the requests in
    flight per adapter (thread-safe; see the module docstring)."""

    def __init__(self, max_loras: int, reserved_names: Iterable[str] = ()):
        self.max_loras = max_loras
        self.reserved_names = frozenset(reserved_names)  # the base model's served names
        self._lock = threading.Lock()
        self._by_name: dict[str, ServedAdapter] = {}
        self._busy_slots: dict[int, str] = {}  # slot -> the adapter loaded, being loaded or being unloaded
        self._use: dict[str, _Use] = {}
        self.loads = 0
        self.unloads = 0
        self.requests: dict[str, int] = {}  # adapter name -> requests (choices) submitted with it

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    # --- names (any thread) ------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._by_name

    def get(self, name: str) -> Optional[ServedAdapter]:
        return self._by_name.get(name)

    def adapters(self) -> list[ServedAdapter]:
        """The served adapters, in slot order."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.slot)

    def in_use(self) -> tuple[list[str], list[str]]:
        """(adapters with requests running, adapters with requests waiting), by name."""
        with self._lock:
            running = sorted(n for n, u in self._use.items() if u.running)
            waiting = sorted(n for n, u in self._use.items() if u.waiting)
        return running, waiting

    def counts(self) -> tuple[int, int, dict[str, int]]:
        """(loads, unloads, choices submitted per adapter name) so far."""
        with self._lock:
            return self.loads, self.unloads, dict(self.requests)

    # --- requests ----------------------------------------------------------------------------

    def acquire(self, names: Sequence[Optional[str]]) -> list[int]:
        """The slots of the adapters named by a request's choices (-1 for None: the base model),
        each choice now counted in flight; ``AdapterGone`` (nothing counted) when one is not served."""
        with self._lock:
            slots = []
            for name in names:
                if name is None:
                    slots.append(-1)
                    continue
                adapter = self._by_name.get(name)
                if adapter is None:
                    raise AdapterGone(name)
                slots.append(adapter.slot)
            for name in names:
                if name is not None:
                    self._use.setdefault(name, _Use()).waiting += 1
                    self.requests[name] = self.requests.get(name, 0) + 1
        return slots

    def scheduled(self, name: str) -> None:
        """A choice of adapter ``name`` was first scheduled: waiting -> running."""
        with self._lock:
            use = self._use.get(name)
            if use is not None and use.waiting:
                use.waiting -= 1
                use.running += 1

    def release(self, name: str, scheduled: bool) -> None:
        """A choice of adapter ``name`` ended (``scheduled``: it had been scheduled)."""
        with self._lock:
            use = self._use.get(name)
            if use is None:
                return
            if scheduled and use.running:
                use.running -= 1
            elif use.waiting:
                use.waiting -= 1
            else:
                use.running = max(use.running - 1, 0)
            if not use.waiting and not use.running:
                del self._use[name]

    # --- loads and unloads -------------------------------------------------------------------

    def reserve(self, name: str, path: str, base_model_name: Optional[str] = None) -> ServedAdapter:
        """A free slot for adapter ``name`` (not yet served: ``commit`` makes it so);
        ``AdapterRefused`` when the name is taken or every slot holds an adapter."""
        if not self.enabled:
            raise _refused(name, 400, "LoRA adapters are not enabled on this server (start it with --enable-lora)")
        if not name or not name.isprintable():
            raise _refused(name, 400, f"lora_name {name!r}: a name must be printable and not empty")
        with self._lock:
            if name in self.reserved_names:
                raise _refused(name, 400, f"The lora adapter '{name}' has the name of the base model.")
            if name in self._by_name or name in self._busy_slots.values():
                raise _refused(name, 400, f"The lora adapter '{name}' has already been loaded.")
            free = [s for s in range(self.max_loras) if s not in self._busy_slots]
            if not free:
                held = ", ".join(sorted(a.name for a in self._by_name.values()))
                raise _refused(name, 400, f"The lora adapter '{name}' cannot be loaded: all {self.max_loras} "
                                          f"adapter slots (--max-loras) hold adapters ({held}); unload one first")
            adapter = ServedAdapter(name, path, free[0], base_model_name)
            self._busy_slots[adapter.slot] = name
        return adapter

    def commit(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._by_name[adapter.name] = adapter
            self.loads += 1

    def abort(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._busy_slots.pop(adapter.slot, None)

    def begin_unload(self, name: str) -> ServedAdapter:
        """Stop serving adapter ``name`` (its slot stays taken until ``unloaded``): 404 when it is not
        served, 400 while requests use it."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise _refused(name, 404, f"The lora adapter '{name}' cannot be found.")
            use = self._use.get(name)
            if use is not None:
                count = use.waiting + use.running
                raise _refused(name, 400, f"The lora adapter '{name}' is in use by {count} request(s) in "
                                          f"flight; unload it once they have finished")
            del self._by_name[name]
        return adapter

    def unloaded(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._busy_slots.pop(adapter.slot, None)
            self.unloads += 1


@dataclass
class AdapterOp:
    """A load or unload for the engine thread (``kind`` "load" or "unload"); ``done`` is set once it
    ran, ``error`` then holds the one-line reason it failed (None: done)."""

    kind: str
    adapter: ServedAdapter
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None
    retry: bool = False  # the slot still had a sequence bound: try again at the next hand-over

    def run(self, engine: Any, book: AdapterBook) -> None:
        """Carry the op out on the engine (the engine thread, between batches)."""
        from fxsched.runtime.torch_model.errors import AdapterError, SlotError

        a = self.adapter
        self.retry = False
        try:
            if self.kind == "load":
                engine.load_adapter(a.slot, Path(a.path))
            else:
                engine.unload_adapter(a.slot)
        except AdapterError as err:
            self.error = str(err)
        except SlotError as err:
            if self.kind == "unload":  # a finished request's sequence not yet freed: at the next hand-over
                self.retry = True
                return
            self.error = f"adapter slot {a.slot}: {err}"
        if self.kind == "load":
            if self.error is None:
                book.commit(a)
                log.info("lora_loaded", name=a.name, slot=a.slot, path=a.path)
            else:
                book.abort(a)
        else:
            book.unloaded(a)
            log.info("lora_unloaded", name=a.name, slot=a.slot)
        self.done.set()
