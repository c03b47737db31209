"""The model a torch command runs (``generate``, ``bench generate``, ``serve``): which one the
arguments name (``ModelChoice``, checked before torch is imported), the device and the CPU threads,
the engine loaded, and its tokenizer.

The model: ``--model DIR`` (a Hugging Face checkpoint directory, through ``HybridEngine.from_pretrained``,
with ``--dtype``, ``--max-seq-len`` and a DFlash ``--draft-model DIR``), ``--weights FILE`` (a
safetensors file of the internal toy model), or, with neither, the embedded default model: the
Hugging Face directory ``specs/models/default/`` (a small Qwen3.5 checkpoint trained on Jane Austen's
novels, with its MTP layer, its tokenizer and a DFlash drafter that ``--spec dflash`` takes when no
``--draft-model`` is given; specs/default-model.md), loaded exactly like a ``--model`` directory. With ``--ep-ranks N > 1`` and neither option the internal toy model runs (the
EP workers build it); with ``--model DIR`` of a MoE checkpoint the N ranks split its experts, each
loading its share from DIR (runtime/cli/ep.py). The tokenizer comes from the model directory (or ``--tokenizer DIR``); a model
without one takes token ids only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from fxsched.runtime.cli.usage import UsageError, _int, normalize_dtype, parse_size


def _torch_device(name: str) -> str:
    import torch

    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available on this machine")
        return name
    raise UsageError(f"--device {name}: unknown device (choose cpu or cuda)")


def host_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _set_threads(value: Optional[str], device: str, checkpoint: bool = False) -> None:
    """torch's CPU threads: ``--threads`` if given, else every core for a checkpoint (the threads
    split each product's weights), else 1 (the embedded model is too small to split)."""
    import torch

    if value is not None:
        torch.set_num_threads(_int(value, "--threads", 1))
    elif device == "cpu":
        torch.set_num_threads(host_cores() if checkpoint else 1)


@dataclass(frozen=True)
class ModelChoice:
    """Which model the command runs, checked before anything is loaded."""

    weights: Optional[str] = None
    model: Optional[str] = None
    dtype: Optional[str] = None
    max_seq_len: Optional[int] = None
    draft_model: Optional[str] = None
    kv_cache_memory: Optional[int] = None
    default: bool = False  # `model` is the embedded default model (no --model / --weights given)
    ep_ranks: int = 1  # > 1: a --model checkpoint is loaded as rank 0's expert shard (runtime/cli/ep.py)
    max_loras: int = 0  # LoRA adapter slots of the engine (specs/lora.md §18.1; 0: none)
    max_lora_rank: int = 16
    max_slots: Optional[int] = None  # sequences the engine holds at once (None: the loader's default, 16)

    @property
    def label(self) -> str:
        """How errors name the model directory."""
        return f"the default model {self.model}" if self.default else f"--model {self.model}"


def _model_choice(args, dflash: bool = False) -> ModelChoice:
    """The model the arguments name. dflash: a DFlash mode will run, so the default model comes with
    its drafter (specs/default-model.md §19.5) unless --draft-model names another."""
    weights, model = getattr(args, "weights", None), getattr(args, "model", None)
    dtype, max_seq_len = getattr(args, "dtype", None), getattr(args, "max_seq_len", None)
    draft_model = getattr(args, "draft_model", None)
    if weights is not None and model is not None:
        raise UsageError("--weights and --model: give one of them, not both")
    dtype = normalize_dtype(dtype)
    default = model is None and weights is None and getattr(args, "ep_ranks", 1) <= 1
    if default:
        from fxsched.runtime.torch_model.default_model import default_drafter_dir, default_model_dir

        model = str(default_model_dir())
        if dflash and draft_model is None and default_drafter_dir().is_dir():
            draft_model = str(default_drafter_dir())
    if model is None:
        if dtype is not None:
            raise UsageError(f"--dtype {dtype}: only for a --model checkpoint (the internal model runs in float32)")
        if max_seq_len is not None:
            raise UsageError(f"--max-seq-len {max_seq_len}: only for a --model checkpoint")
        if getattr(args, "kv_cache_memory", None) is not None:
            raise UsageError(f"--kv-cache-memory {args.kv_cache_memory}: only for a --model checkpoint")
        if draft_model is not None:
            raise UsageError(f"--draft-model {draft_model}: only for a --model checkpoint")
        return ModelChoice(weights=weights)
    if not Path(model).is_dir():
        what = "the default model" if default else "--model"
        raise UsageError(f"{what} {model}: no such directory")
    if not default:  # config.json first, before torch is imported (runtime/cli/checkpoint.py)
        from fxsched.runtime.cli.checkpoint import CheckpointProblem, check_checkpoint

        try:
            check_checkpoint(model, f"--model {model}")
        except CheckpointProblem as err:
            raise UsageError(str(err)) from None
    if draft_model is not None and not Path(draft_model).is_dir():
        raise UsageError(f"--draft-model {draft_model}: no such directory")
    length = _int(max_seq_len, "--max-seq-len", 16) if max_seq_len is not None else None
    kv_text = getattr(args, "kv_cache_memory", None)
    kv_memory = parse_size(kv_text, "--kv-cache-memory") if kv_text is not None else None
    ranks = getattr(args, "ep_ranks", 1)
    return ModelChoice(model=model, dtype=dtype, max_seq_len=length, draft_model=draft_model,
                       kv_cache_memory=kv_memory, default=default,
                       ep_ranks=ranks if isinstance(ranks, int) else 1)


def _engine(choice: ModelChoice | Optional[str], device: str):
    """The engine of a ``ModelChoice`` (or of a weights path / ``None``, as before)."""
    from fxsched.runtime.torch_model import HybridEngine, default_config
    from fxsched.runtime.torch_model.errors import TorchModelError

    if not isinstance(choice, ModelChoice):
        choice = ModelChoice(weights=choice)
    if choice.model is not None:
        return _pretrained(choice, device)
    if choice.weights is None:
        return HybridEngine(default_config(), device=device)
    path = Path(choice.weights)
    if path.is_dir():
        raise UsageError(f"--weights {choice.weights}: is a directory, not a safetensors file (for a Hugging Face "
                         f"checkpoint directory give --model {choice.weights})")
    if not path.is_file():
        raise UsageError(f"--weights {choice.weights}: no such file")
    try:
        return HybridEngine.from_weights_file(path, device=device)
    except (TorchModelError, OSError, ValueError) as err:
        raise UsageError(f"--weights {choice.weights}: {err}") from None


def _pretrained(choice: ModelChoice, device: str):
    from fxsched.runtime.torch_model import HybridEngine
    from fxsched.runtime.torch_model.errors import TorchModelError

    assert choice.model is not None
    from_pretrained = getattr(HybridEngine, "from_pretrained", None)
    if from_pretrained is None:
        raise UsageError(f"{choice.label}: this build cannot load Hugging Face checkpoints yet "
                         f"(HybridEngine.from_pretrained is missing)")
    kwargs: dict[str, Any] = {"device": device}
    if choice.dtype is not None:
        kwargs["dtype"] = choice.dtype
    if choice.max_seq_len is not None:
        kwargs["max_seq_len"] = choice.max_seq_len
    if choice.draft_model is not None:
        kwargs["draft_model"] = choice.draft_model
    if choice.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = choice.kv_cache_memory
    if choice.ep_ranks > 1:
        kwargs["expert_shard"] = (0, choice.ep_ranks)
    if choice.max_loras:
        kwargs.update(max_loras=choice.max_loras, max_lora_rank=choice.max_lora_rank)
    if choice.max_slots is not None:
        kwargs["max_slots"] = choice.max_slots
    try:
        return from_pretrained(choice.model, **kwargs)
    except TorchModelError as err:  # ModelDirError among them: the message names the file
        if getattr(err, "field", None) == "kv_cache_memory":
            raise UsageError(f"--kv-cache-memory {choice.kv_cache_memory}: {choice.label} needs "
                             f"{getattr(err, 'expected', '')}") from None
        if getattr(err, "field", None) == "expert_shard":
            expected = getattr(err, "expected", "")
            raise UsageError(f"--ep-ranks {choice.ep_ranks}: {choice.label} takes {expected}") from None
        raise UsageError(f"{_blame(choice, err)}: {_one_line(err)}") from None
    except (OSError, ValueError) as err:
        raise UsageError(f"{_blame(choice, err)}: {type(err).__name__}: {_one_line(err)}") from None


def _blame(choice: ModelChoice, err: BaseException) -> str:
    """The option a loading error is about: the drafter directory when the message names it."""
    if choice.draft_model is not None and str(Path(choice.draft_model)) in str(err):
        return f"--draft-model {choice.draft_model}"
    return choice.label


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def _check_text_model(args, choice: ModelChoice, option: str) -> None:
    """A text prompt needs a tokenizer: checked on the files, before torch is imported (the
    tokenizer itself is loaded and checked later, by ``_tokenizer``)."""
    from fxsched.runtime.cli.checkpoint import has_tokenizer

    if option not in ("--prompt", "--prompt-file") or getattr(args, "tokenizer", None) is not None:
        return
    if choice.model is not None and not choice.default and not has_tokenizer(choice.model):
        ids_option = "--prompt-ids" if option == "--prompt" else "--prompt-ids-file"
        raise UsageError(f"{option}: the model has no tokenizer (no tokenizer.json in --model {choice.model}), so "
                         f"it takes token ids: use {ids_option} (or --tokenizer DIR)")


def _tokenizer(args, choice: ModelChoice):
    """The tokenizer of ``--tokenizer DIR``, else of the ``--model`` directory; None without one."""
    from fxsched.runtime.text import TokenizerError, load_tokenizer

    directory = getattr(args, "tokenizer", None)
    option = "--tokenizer"
    if directory is None:
        directory, option = choice.model, ("the default model" if choice.default else "--model")
    if directory is None:
        return None
    try:
        tokenizer = load_tokenizer(directory)
    except TokenizerError as err:
        raise UsageError(f"{option}: {err}") from None
    if tokenizer is None and option == "--tokenizer":
        raise UsageError(f"--tokenizer {directory}: no tokenizer.json in it")
    return tokenizer
