"""Scenarios as data: ``specs/scenarios/<name>.toml`` loaded and validated into frozen records.

A malformed file or an unknown field raises ``ScenarioError`` naming the file, the field and what
was expected; nothing is half-loaded (specs/scenarios.md §2.5).

Limits are checked at load, so a run never starts on a value it cannot finish with: every integer
field has a range (``_RANGES``: sizes and counts at most a million, the batch and the block size
at least 1, budgets ``max_tokens`` at least 1, ``num_beams`` at most the scheduler's beam group
size), every number is finite, every script, beam and boundary token lies in the model's
vocabulary (which holds the scripted EOS 63), and the request's own checks (``Request``'s
sampling ranges) run here too. The fault fields ``kv_exhaust_at``, ``decode_fault_at``,
``spill_corrupt_for`` and ``spill_missing_for`` are lists of integers, like the scripts.
"""

from __future__ import annotations

import importlib.resources
import math
import re
import tomllib
from pathlib import Path
from typing import Any, Optional

import attrs

from fxsched.core.config import SCRIPTED_EOS as EOS
from fxsched.core.prefill import MAX_BEAMS_PER_GROUP
from fxsched.core.request import Request
from fxsched.runtime.devices.recording import DeviceConfig
from fxsched.runtime.devices.script_rules import Script
from fxsched.runtime.files import read_text


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
_LIST_FIELDS = ("tokens", "beam_hyp", "boundary_tokens", "kv_exhaust_at", "decode_fault_at", "spill_corrupt_for",
                "spill_missing_for")
_TOKEN_FIELDS = ("tokens", "beam_hyp", "boundary_tokens", "think_start_token", "think_end_token")

MILLION = 1_000_000
MAX_SCRIPT = 100_000  # tokens in one script (the context holds 4096)
MAX_LIST = 10_000  # entries of a fault list
# Inclusive ranges of the integer fields (list fields: of each entry; tokens are checked against
# the vocabulary as well); a field not named here is a boolean, a number or a string.
_RANGES: dict[str, tuple[int, int]] = {
    # [[requests]]
    "id": (0, MILLION), "prompt_len": (1, MILLION), "max_tokens": (1, MILLION), "min_tokens": (0, MILLION),
    "top_logprobs": (0, MILLION), "top_k": (0, MILLION), "num_beams": (1, MAX_BEAMS_PER_GROUP),
    "draft_wrong_every": (0, MILLION), "cancel_at": (0, MILLION), "arrive_at_tick": (0, MILLION),
    "tokens": (0, MILLION), "beam_hyp": (0, MILLION),
    # [model]
    "vocab": (EOS + 1, MILLION), "block_size": (1, 4096), "total_blocks": (1, MILLION),
    "held_blocks": (0, MILLION), "reclaimable": (0, MILLION), "dflash_gamma": (1, 64), "ring_slots": (0, 1024),
    "slot_draft_capacity": (0, 1024), "kv_exhaust_at": (0, MILLION), "decode_fault_at": (0, MILLION),
    "spill_corrupt_for": (0, MILLION), "spill_missing_for": (0, MILLION),
    # [options]
    "max_batch_size": (1, 1024), "num_drafts": (0, 32), "max_prefill_tokens": (0, MILLION),
    "max_batch_tokens": (1, 10 * MILLION), "boundary_tokens": (0, MILLION), "think_start_token": (0, MILLION),
    "think_end_token": (0, MILLION),
}
_FLOAT_RANGES: dict[str, tuple[float, float]] = {"temperature": (0.0, 1000.0), "swap_space_gb": (0.0, 1024.0)}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def _kind_of(cls, name: str) -> str:
    field = attrs.fields_dict(cls)[name]
    default = field.default
    if name in _LIST_FIELDS:
        return _INTS
    if name in ("temperature", "top_p", "min_p", "swap_space_gb"):
        return _FLOAT
    if name in ("lora_rotation",):
        return _STR
    if isinstance(default, bool):
        return _BOOL
    return _INT


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(value: Any, kind: str) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return _is_int(value)
    if kind == _FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _INTS:
        return isinstance(value, list) and all(_is_int(v) for v in value)
    return False


def _show(value: Any) -> str:
    """A value for an error message, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_range(key: str, kind: str, value: Any, where: str) -> None:
    """Refuse a value outside its field's range (an integer, a list of them, or a number)."""
    if kind == _FLOAT and value is not None:
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        low_f, high_f = _FLOAT_RANGES.get(key, (-math.inf, math.inf))
        if not (math.isfinite(number) and low_f <= number <= high_f):
            expected = f"a finite number from {low_f:g} to {high_f:g}" if key in _FLOAT_RANGES else "a finite number"
            raise ScenarioError(f"{where}: field '{key}' = {_show(value)} is out of range (expected {expected})")
    if key not in _RANGES or value is None:
        return
    low, high = _RANGES[key]
    if isinstance(value, list):
        limit = MAX_SCRIPT if key in _TOKEN_FIELDS else MAX_LIST
        if len(value) > limit:
            raise ScenarioError(f"{where}: field '{key}' has {len(value)} entries (at most {limit})")
        bad = next((v for v in value if not low <= v <= high), None)
        if bad is not None:
            raise ScenarioError(f"{where}: field '{key}' holds {_show(bad)}, out of range "
                                f"(each entry from {low} to {high})")
    elif key == "prompt_len" and value < 1:
        raise ScenarioError(f"{where}: field 'prompt_len' = {_show(value)} expects a positive integer "
                            f"(the prompt is empty)")
    elif not low <= value <= high:
        raise ScenarioError(f"{where}: field '{key}' = {_show(value)} is out of range (expected {low} to {high})")


def _expand_tokens(value: Any, where: str) -> Any:
    """``tokens`` may be a list, or ``{toks = n, base = b, eos = bool}`` (specs/scenarios.md §2.1)."""
    if isinstance(value, dict):
        unknown = set(value) - {"toks", "base", "eos"}
        toks, base, eos = value.get("toks"), value.get("base"), value.get("eos", False)
        if unknown or not isinstance(toks, int) or not isinstance(base, int) or not isinstance(eos, bool) \
                or isinstance(toks, bool) or isinstance(base, bool):
            raise ScenarioError(f"{where}: field 'tokens' expects a list of integers or "
                                f"{{toks = N, base = B, eos = true|false}}")
        if not 0 <= toks <= MAX_SCRIPT:
            raise ScenarioError(f"{where}: field 'tokens' has toks = {_show(toks)}, out of range "
                                f"(expected 0 to {MAX_SCRIPT})")
        if not 0 <= base <= MILLION:
            raise ScenarioError(f"{where}: field 'tokens' has base = {_show(base)}, out of range "
                                f"(expected 0 to {MILLION})")
        out = [base + (i % 20) for i in range(toks)]
        if eos:
            out.append(EOS)
        return out
    return value


def _build(cls, table: Any, where: str, required: tuple[str, ...] = ()):
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: expected a table")
    known = attrs.fields_dict(cls)
    for key in table:
        if key not in known:
            raise ScenarioError(f"{where}: unknown field {_show(key)} (expected one of: {', '.join(sorted(known))})")
    for key in required:
        if key not in table:
            raise ScenarioError(f"{where}: missing field '{key}'")
    kwargs = {}
    for key, value in table.items():
        if key == "tokens":
            value = _expand_tokens(value, where)
        kind = _kind_of(cls, key)
        if value is not None and not _check(value, kind):
            raise ScenarioError(f"{where}: field '{key}' expects {kind}, got {_show(value)}")
        _check_range(key, kind, value, where)
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def _check_tokens(where: str, values: dict[str, Any], vocab: int) -> None:
    """Every token a field names lies in the vocabulary ``[0, vocab)``."""
    for key, value in values.items():
        tokens = value if isinstance(value, tuple) else (() if value is None else (value,))
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ScenarioError(f"{where}: field '{key}' holds token {_show(bad)}, outside the vocabulary "
                                f"[0, {vocab})")


def _check_model(model: DeviceConfig, where: str) -> None:
    if model.held_blocks > model.total_blocks:
        raise ScenarioError(f"{where}: field 'held_blocks' = {model.held_blocks} is more than total_blocks = "
                            f"{model.total_blocks}")


def _check_request(spec: RequestSpec, vocab: int, where: str) -> None:
    _check_tokens(where, {"tokens": spec.tokens, "beam_hyp": spec.beam_hyp}, vocab)
    if spec.min_tokens > spec.max_tokens:
        raise ScenarioError(f"{where}: field 'min_tokens' = {spec.min_tokens} is more than max_tokens = "
                            f"{spec.max_tokens}")
    if spec.top_logprobs > vocab:
        raise ScenarioError(f"{where}: field 'top_logprobs' = {spec.top_logprobs} is more than the vocabulary "
                            f"({vocab})")
    try:
        spec.request()
    except ValueError as err:  # Request's own range checks (sampling fields)
        raise ScenarioError(f"{where}: {err}") from None


def parse_scenario(data: dict, source: str) -> Scenario:
    """Validate a parsed TOML document into a ``Scenario``."""
    allowed = {"name", "model", "options", "requests"}
    for key in data:
        if key not in allowed:
            raise ScenarioError(f"{source}: unknown top-level field {_show(key)} "
                                f"(expected one of: {', '.join(sorted(allowed))})")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ScenarioError(f"{source}: field 'name' expects a name of up to 100 letters, digits, '_', '.' "
                            f"and '-' (starting with a letter or digit), got {_show(name)}")
    model = _build(DeviceConfig, data.get("model", {}), f"{source} [model]")
    _check_model(model, f"{source} [model]")
    options = _build(RunOptions, data.get("options", {}), f"{source} [options]")
    _check_tokens(f"{source} [options]", {"boundary_tokens": options.boundary_tokens,
                                          "think_start_token": options.think_start_token,
                                          "think_end_token": options.think_end_token}, model.vocab)
    if options.lora_rotation is not None and not _NAME.fullmatch(options.lora_rotation):
        raise ScenarioError(f"{source} [options]: field 'lora_rotation' expects an adapter name of up to 100 "
                            f"letters, digits, '_', '.' and '-', got {_show(options.lora_rotation)}")
    raw = data.get("requests")
    if not isinstance(raw, list) or not raw:
        raise ScenarioError(f"{source}: field 'requests' expects at least one [[requests]] table")
    if len(raw) > 1000:
        raise ScenarioError(f"{source}: {len(raw)} [[requests]] tables (at most 1000)")
    specs = []
    for index, table in enumerate(raw):
        where = f"{source} [[requests]] #{index + 1}"
        if isinstance(table, dict) and isinstance(table.get("tokens"), (list, dict)) and "max_tokens" not in table:
            table = dict(table, max_tokens=max(len(_expand_tokens(table["tokens"], where)), 1))
        spec = _build(RequestSpec, table, where, required=("id", "prompt_len", "tokens"))
        if not spec.tokens:
            raise ScenarioError(f"{where}: field 'tokens' expects at least one scripted token")
        _check_request(spec, model.vocab, where)
        specs.append(spec)
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        raise ScenarioError(f"{source}: request ids must be unique, got {_show(ids)}")
    return Scenario(name, model, options, tuple(specs), source)


def load_scenario_file(path: Path) -> Scenario:
    text = read_text(path, "scenario file", ScenarioError)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"{path}: not valid TOML ({err})") from None
    except RecursionError:
        raise ScenarioError(f"{path}: not valid TOML (nested too deeply)") from None
    return parse_scenario(data, str(path))


def specs_dir() -> Path:
    return Path(str(importlib.resources.files("fxsched.specs")))


def scenario_names() -> list[str]:
    """Known scenarios, in the reference run order where the files give one."""
    return sorted(p.stem for p in (specs_dir() / "scenarios").glob("*.toml"))


def shipped_scenario_path(name: str) -> Optional[Path]:
    """The file of a shipped scenario (``specs/scenarios/<name>.toml``), None for another name."""
    return specs_dir() / "scenarios" / f"{name}.toml" if name in scenario_names() else None


def is_shipped(scenario: Scenario) -> bool:
    """Whether ``scenario`` was loaded from its own shipped file (by name or by that file's path)."""
    path = shipped_scenario_path(scenario.name)
    if path is None:
        return False
    try:
        return Path(scenario.source).resolve() == path.resolve()
    except OSError:
        return False


def load_scenario(name_or_path: str) -> Scenario:
    """A scenario by name (from ``specs/scenarios``) or by path to a ``.toml`` file."""
    path = Path(name_or_path)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError):  # a name too long for a path, say
        is_file = is_dir = False
    if name_or_path.endswith(".toml") or is_file:
        return load_scenario_file(path)
    candidate = shipped_scenario_path(name_or_path)
    if candidate is None and is_dir:
        raise ScenarioError(f"{name_or_path}: is a directory, not a scenario file")
    if candidate is None:
        known = ", ".join(scenario_names())
        raise ScenarioError(f"unknown scenario {_show(name_or_path)} (known: {known})")
    return load_scenario_file(candidate)
