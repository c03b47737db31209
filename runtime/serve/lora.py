"""LoRA adapters served by name (specs/lora.md §18.7): the book of served adapters, which of them are
resident in the engine's pool, the requests in flight per adapter, and the loads, evictions and
unloads the engine thread carries out.

Served and resident. An adapter is *served* from the moment it is listed (``--lora-modules``, or
``/v1/load_lora_adapter``) until it is unloaded; it is *resident* while it holds one of the engine's
``--max-loras`` pool slots. A listed adapter is read and checked at once (a bad one is refused then)
and loaded into a free slot if there is one; otherwise it stays on disk until a request names it.
A request naming an adapter that is not resident is placed by the engine thread when it is handed
over: into a free slot, else into the slot of the least recently used resident adapter that no
request in flight names (that adapter is evicted: it stays served, and is loaded again when named);
when every slot's adapter has requests in flight, the request waits, in order, until one has none
(vLLM's ``--max-loras`` is the same bound: adapters in one batch). A request holds its adapter from
``submit`` on, so a resident adapter with requests in flight is never evicted.

Threads. ``AdapterBook`` is read and written under its own lock by the HTTP side (names, submit,
the load and unload routes) and by the engine thread (placement, a choice's end). The pool itself
(the engine's ``LoraPool``) is touched only by the engine thread: a load or an unload is an
``AdapterOp`` put on the engine's inbox and carried out between two batches (``AdapterOp.run``), as
are placements (``ServeEngine._place``); an op's caller waits for its ``done`` event. Before the
engine thread starts (the adapters of the command line) the op runs at once on the caller's thread.

Unloading an adapter that requests still use (submitted, not finished: waiting for a slot, queued,
running or spilled) is refused with a 400 naming it and the count; from the moment an unload is
accepted, requests naming the adapter get the 404 of an unknown model.
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
    """An adapter the server serves: its name, its directory as given (``/v1/models``' ``root``) and
    the base model name it reports as ``parent`` (None: the served model's)."""

    name: str
    path: str
    base_model_name: Optional[str] = None


@dataclass
class _Use:
    waiting: int = 0  # submitted, not yet scheduled
    running: int = 0  # scheduled (prefilling, decoding, preempted or spilled), not finished


class AdapterBook:
    """The served adapters by name (in the order they were listed), the pool slots of the resident
    ones and the requests in flight per adapter (thread-safe; see the module docstring)."""

    def __init__(self, max_loras: int, reserved_names: Iterable[str] = ()):
        self.max_loras = max_loras
        self.reserved_names = frozenset(reserved_names)  # the base model's served names
        self._lock = threading.Lock()
        self._by_name: dict[str, ServedAdapter] = {}
        self._arriving: set[str] = set()  # names being listed (reserved, not yet committed)
        self._slot_of: dict[str, int] = {}  # resident adapters (and ones being unloaded) -> their pool slot
        self._recent: dict[str, int] = {}  # resident adapter -> when a request last named it (a counter)
        self._clock = 0
        self._use: dict[str, _Use] = {}
        self.loads = 0  # adapters loaded into a pool slot (when listed, and on demand)
        self.evictions = 0  # resident adapters whose slot went to another on demand
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
        """The served adapters, in the order they were listed."""
        with self._lock:
            return list(self._by_name.values())

    def resident(self) -> dict[str, int]:
        """The served adapters that hold a pool slot, by name."""
        with self._lock:
            return {n: s for n, s in self._slot_of.items() if n in self._by_name}

    def in_use(self) -> tuple[list[str], list[str]]:
        """(adapters with requests running, adapters with requests waiting), by name."""
        with self._lock:
            running = sorted(n for n, u in self._use.items() if u.running)
            waiting = sorted(n for n, u in self._use.items() if u.waiting)
        return running, waiting

    def counts(self) -> tuple[int, int, int, dict[str, int]]:
        """(loads, evictions, unloads, choices submitted per adapter name) so far."""
        with self._lock:
            return self.loads, self.evictions, self.unloads, dict(self.requests)

    # --- requests ----------------------------------------------------------------------------

    def acquire(self, names: Sequence[Optional[str]]) -> None:
        """Count the choices of a request in flight with the adapters they name (None: the base
        model); ``AdapterGone`` (nothing counted) when one is not served."""
        with self._lock:
            for name in names:
                if name is not None and name not in self._by_name:
                    raise AdapterGone(name)
            for name in names:
                if name is not None:
                    self._use.setdefault(name, _Use()).waiting += 1
                    self.requests[name] = self.requests.get(name, 0) + 1

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

    # --- placement (the engine thread) -------------------------------------------------------

    def slot_for(self, name: str) -> Optional[int]:
        """The pool slot of resident adapter ``name`` (its recency refreshed), None if not resident."""
        with self._lock:
            slot = self._slot_of.get(name)
            if slot is not None:
                self._clock += 1
                self._recent[name] = self._clock
            return slot

    def free_slot(self) -> Optional[int]:
        """The lowest pool slot no adapter holds (None: all hold one)."""
        with self._lock:
            taken = set(self._slot_of.values())
        return next((s for s in range(self.max_loras) if s not in taken), None)

    def idle(self) -> list[tuple[str, int]]:
        """Resident adapters that no request in flight names, least recently used first (with slots)."""
        with self._lock:
            names = [n for n in self._slot_of if n in self._by_name and n not in self._use]
            return sorted(((n, self._slot_of[n]) for n in names), key=lambda p: (self._recent.get(p[0], 0), p[1]))

    def placed(self, name: str, slot: int) -> None:
        """Adapter ``name`` was loaded into ``slot``."""
        with self._lock:
            self._slot_of[name] = slot
            self._clock += 1
            self._recent[name] = self._clock
            self.loads += 1

    def evicted(self, name: str) -> None:
        """Resident adapter ``name`` gave its slot up (it stays served)."""
        with self._lock:
            self._slot_of.pop(name, None)
            self._recent.pop(name, None)
            self.evictions += 1

    # --- listing and unlisting ---------------------------------------------------------------

    def reserve(self, name: str, path: str, base_model_name: Optional[str] = None) -> ServedAdapter:
        """Adapter ``name``, about to be listed (``commit`` serves it); ``AdapterRefused`` when the
        name is not usable or taken."""
        if not self.enabled:
            raise _refused(name, 400, "LoRA adapters are not enabled on this server (start it with --enable-lora)")
        if not name or not name.isprintable():
            raise _refused(name, 400, f"lora_name {name!r}: a name must be printable and not empty")
        with self._lock:
            if name in self.reserved_names:
                raise _refused(name, 400, f"The lora adapter '{name}' has the name of the base model.")
            if name in self._by_name or name in self._arriving or name in self._slot_of:
                raise _refused(name, 400, f"The lora adapter '{name}' has already been loaded.")
            self._arriving.add(name)
        return ServedAdapter(name, path, base_model_name)

    def commit(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._arriving.discard(adapter.name)
            self._by_name[adapter.name] = adapter

    def abort(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._arriving.discard(adapter.name)

    def begin_unload(self, name: str) -> ServedAdapter:
        """Stop serving adapter ``name`` (a slot it holds stays taken until ``unloaded``): 404 when
        it is not served, 400 while requests use it."""
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

    def leaving_slot(self, adapter: ServedAdapter) -> Optional[int]:
        """The pool slot an adapter being unloaded holds (None: it is not resident)."""
        with self._lock:
            return self._slot_of.get(adapter.name)

    def unloaded(self, adapter: ServedAdapter) -> None:
        with self._lock:
            self._slot_of.pop(adapter.name, None)
            self._recent.pop(adapter.name, None)
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
        """Carry the op out on the engine (the engine thread, between batches): a load reads and
        checks the adapter, into the lowest free slot if there is one (else it waits on disk until a
        request names it); an unload empties the slot the adapter holds, if any."""
        from fxsched.runtime.torch_model.errors import AdapterError, SlotError

        a = self.adapter
        self.retry = False
        slot: Optional[int] = None
        try:
            if self.kind == "load":
                slot = book.free_slot()
                if slot is None:
                    engine.check_adapter(Path(a.path))
                else:
                    engine.load_adapter(slot, Path(a.path))
            else:
                slot = book.leaving_slot(a)
                if slot is not None:
                    engine.unload_adapter(slot)
        except AdapterError as err:
            self.error = str(err)
        except SlotError as err:
            if self.kind == "unload":  # a finished request's sequence not yet freed: at the next hand-over
                self.retry = True
                return
            self.error = f"adapter slot {slot}: {err}"
        if self.kind == "load":
            if self.error is None:
                book.commit(a)
                if slot is not None:
                    book.placed(a.name, slot)
                log.info("lora_loaded", name=a.name, slot=slot, path=a.path)
            else:
                book.abort(a)
        else:
            book.unloaded(a)
            log.info("lora_unloaded", name=a.name, slot=slot)
        self.done.set()
