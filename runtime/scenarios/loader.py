"""Scenarios as data: ``specs/scenarios/<name>.toml`` loaded and validated into frozen records.

A malformed file or an unknown field raises ``ScenarioError`` naming the file, the field and what
was expected; nothing is half-loaded.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path
from typing import Any, Optional

import attrs

from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.request import Request
from fxsched.runtime.devices.recording import DeviceConfig
from fxsched.runtime.devices.scripted import Script



class ScenarioError(Exception):
    """A scenario that cannot be loaded or run; the message names the file or scenario."""


@attrs.frozen
class RequestSpec:
    id: int
    prompt_len: int
    tokens: tuple[int, ...]
    max_tokens: int
    min_tokens: int = 0
    streaming: bool = True
    temperature: float = 0.0
    top_logprobs: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    num_beams: int = 1
    beam_hyp: tuple[int, ...] = ()
    draft_wrong_every: int = 0
    cancel_at: Optional[int] = None
    expired_deadline: bool = False
    arrive_at_tick: Optional[int] = None

    def prompt(self) -> tuple[int, ...]:
        """Position 0 holds the request id; position i >= 1 holds ``2 + (i mod 7)``."""
        return (self.id,) + tuple(2 + (i % 7) for i in range(1, self.prompt_len))

    def request(self) -> Request:
        return Request(
            id=self.id, prompt=self.prompt(), max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            streaming=self.streaming, temperature=self.temperature, top_logprobs=self.top_logprobs,
            num_beams=self.num_beams, adapter_slot=-1, seed=42,
            deadline_ms=-1.0 if self.expired_deadline else None,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
        )

    def script(self) -> Script:
        return Script(self.prompt_len, self.tokens, self.draft_wrong_every, self.beam_hyp, self.cancel_at)


@attrs.frozen
class RunOptions:
    max_batch_size: int = 8
    use_speculative: bool = False
    dflash: bool = False
    num_drafts: int = 1
    max_prefill_tokens: int = 0
    max_batch_tokens: int = 8192
    self_speculative: bool = False
    ngram_speculative: bool = False
    ngram_history_without_pending_token: bool = False
    swap_space_gb: float = 0.0
    slai_policy: bool = False
    loop_watchdog: bool = False
    boundary_tokens: tuple[int, ...] = ()
    lora_rotation: Optional[str] = None
    think_start_token: Optional[int] = None
    think_end_token: Optional[int] = None


@attrs.frozen
class Scenario:
    name: str
    model: DeviceConfig
    options: RunOptions
    requests: tuple[RequestSpec, ...]
    source: str = ""


# --- validation ----------------------------------------------------------------------------------

_INT, _BOOL, _FLOAT, _STR, _INTS = "an integer", "a boolean", "a number", "a string", "a list of integers"


def _kind_of(cls, name: str) -> str:
    field = attrs.fields_dict(cls)[name]
    default = field.default
    if name in ("tokens", "beam_hyp", "boundary_tokens", "kv_exhaust_at"):
        return _INTS
    if name in ("temperature", "top_p", "min_p", "swap_space_gb"):
        return _FLOAT
    if name in ("lora_rotation",):
        return _STR
    if isinstance(default, bool):
        return _BOOL
    return _INT


def _check(value: Any, kind: str) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _INTS:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return False


def _expand_tokens(value: Any, where: str) -> Any:
    """``tokens`` may be a list, or ``{toks = n, base = b, eos = bool}`` (specs/scenarios.md §2.1)."""
    if isinstance(value, dict):
        unknown = set(value) - {"toks", "base", "eos"}
        if unknown or not isinstance(value.get("toks"), int) or not isinstance(value.get("base"), int):
            raise ScenarioError(f"{where}: field 'tokens' expects a list of integers or "
                                f"{{toks = N, base = B, eos = true|false}}")
        out = [value["base"] + (i % 20) for i in range(value["toks"])]
        if value.get("eos", False):
            out.append(EOS)
        return out
    return value


def _build(cls, table: Any, where: str, required: tuple[str, ...] = ()):
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: expected a table")
    known = attrs.fields_dict(cls)
    for key in table:
        if key not in known:
            raise ScenarioError(f"{where}: unknown field '{key}' (expected one of: {', '.join(sorted(known))})")
    for key in required:
        if key not in table:
            raise ScenarioError(f"{where}: missing field '{key}'")
    kwargs = {}
    for key, value in table.items():
        if key == "tokens":
            value = _expand_tokens(value, where)
        kind = _kind_of(cls, key)
        if value is not None and not _check(value, kind):
            raise ScenarioError(f"{where}: field '{key}' expects {kind}, got {value!r}")
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def parse_scenario(data: dict, source: str) -> Scenario:
    """Validate a parsed TOML document into a ``Scenario``."""
    allowed = {"name", "model", "options", "requests"}
    for key in data:
        if key not in allowed:
            raise ScenarioError(f"{source}: unknown top-level field '{key}' (expected one of: {', '.join(sorted(allowed))})")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"{source}: field 'name' expects a non-empty string")
    model = _build(DeviceConfig, data.get("model", {}), f"{source} [model]")
    options = _build(RunOptions, data.get("options", {}), f"{source} [options]")
    raw = data.get("requests")
    if not isinstance(raw, list) or not raw:
        raise ScenarioError(f"{source}: field 'requests' expects at least one [[requests]] table")
    specs = []
    for index, table in enumerate(raw):
        where = f"{source} [[requests]] #{index + 1}"
        if isinstance(table, dict) and "tokens" in table and "max_tokens" not in table:
            table = dict(table, max_tokens=len(_expand_tokens(table["tokens"], where)))
        spec = _build(RequestSpec, table, where, required=("id", "prompt_len", "tokens"))
        if spec.prompt_len < 1:
            raise ScenarioError(f"{where}: field 'prompt_len' expects a positive integer (the prompt is empty)")
        if not spec.tokens:
            raise ScenarioError(f"{where}: field 'tokens' expects at least one scripted token")
        specs.append(spec)
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        raise ScenarioError(f"{source}: request ids must be unique, got {ids}")
    return Scenario(name, model, options, tuple(specs), source)


def load_scenario_file(path: Path) -> Scenario:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file") from None
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"{path}: not valid TOML ({err})") from None
    return parse_scenario(data, str(path))


def specs_dir() -> Path:
    return Path(str(importlib.resources.files("fxsched.specs")))


def scenario_names() -> list[str]:
    """Known scenarios, in the reference run order where the files give one."""
    return sorted(p.stem for p in (specs_dir() / "scenarios").glob("*.toml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A scenario by name (from ``specs/scenarios``) or by path to a ``.toml`` file."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") or path.exists() and path.is_file():
        return load_scenario_file(path)
    candidate = specs_dir() / "scenarios" / f"{name_or_path}.toml"
    if not candidate.exists():
        known = ", ".join(scenario_names())
        raise ScenarioError(f"unknown scenario '{name_or_path}' (known: {known})")
    return load_scenario_file(candidate)
