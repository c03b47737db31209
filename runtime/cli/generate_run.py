"""The runs of ``fxsched generate`` and ``fxsched bench generate``: the arguments checked (first
what needs no torch: the numbers, the paths and the prompt files, so a bad one is refused within a
second), the model loaded, the requests run through the scheduler and the results printed.

``--record FILE`` writes the run's event log (``fxsched.runtime.eventlog``, specs/event-log.md):
``fxsched replay FILE`` re-runs the scheduler over it without the model. A path that cannot be
written, or an existing file without ``--force``, is refused before the model loads, and the file
is only created once the input is checked.

Ctrl-C during a run prints what was generated so far (each unfinished request with finish reason
"interrupted", then the summary), one line on stderr, and exits 130; with ``--ep-ranks`` the
workers ignore it and the leader tears them down.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Optional

from fxsched.runtime.cli.generate_lora import _load_adapters, _lora_choice
from fxsched.runtime.cli.generate_output import Printer
from fxsched.runtime.cli.generate_prompts import _lines, _prompt_option, _prompts
from fxsched.runtime.cli.model_choice import (ModelChoice, _check_text_model, _engine, _model_choice, _set_threads,
                                              _tokenizer, _torch_device)
from fxsched.runtime.cli.usage import (EXIT_FAILED, EXIT_INTERRUPTED, MAX_SEQUENCES, SPECS, UsageError, _float, _int,
                                       normalize_dtype)

PROGRESS_MIN_TOKENS = 512  # show a progress bar when a run may produce this many tokens


def _sampling(args):
    """The run's ``SamplingOptions`` from the sampling flags (their ranges: ``Request``'s checks)."""
    from fxsched.runtime.generate import GenerateError, SamplingOptions

    def given(name: str, default: str) -> str:
        value = getattr(args, name, None)
        return default if value is None else str(value)

    seed = _int(given("seed", "0"), "--seed", -(2**62), 2**62)

    try:
        return SamplingOptions(
            temperature=_float(given("temperature", "0"), "--temperature"),
            top_p=_float(given("top_p", "1"), "--top-p"),
            top_k=_int(given("top_k", "0"), "--top-k", 0),
            min_p=_float(given("min_p", "0"), "--min-p"),
            seed=seed,
            logprobs=_int(given("logprobs", "0"), "--logprobs", 0),
        )
    except GenerateError as err:
        raise UsageError(str(err)) from None


def run_generate(args, out=None) -> int:
    """``fxsched generate``; raises UsageError for bad input."""
    out = out or sys.stdout
    # what can be checked without torch first (an error within a second): the numbers, the paths,
    # the prompt files (read, bounded, now; tokenized once the tokenizer is loaded)
    if args.spec not in SPECS:
        raise UsageError(f"--spec {args.spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    max_tokens = _int(args.max_tokens, "--max-tokens", 1)
    batch = _int(args.batch, "--batch", 1, MAX_SEQUENCES)
    for name, default in (("temperature", "0"), ("top_p", "1"), ("min_p", "0")):
        _float(str(getattr(args, name, None) or default), "--" + name.replace("_", "-"))
    for name, default in (("top_k", "0"), ("logprobs", "0")):
        _int(str(getattr(args, name, None) or default), "--" + name.replace("_", "-"), 0)
    _int(str(getattr(args, "seed", None) or "0"), "--seed", -(2**62), 2**62)
    if _int(str(getattr(args, "logprobs", None) or "0"), "--logprobs", 0) and not args.json:
        raise UsageError(f"--logprobs {args.logprobs}: needs --json (the logprobs are written in its records)")
    args.dtype = normalize_dtype(getattr(args, "dtype", None))
    option, value = _prompt_option(args)
    if option.endswith("-file"):
        args.prompt_lines = _lines(option, value)
    stops = tuple(getattr(args, "stop", None) or ())
    if any(not s for s in stops):
        raise UsageError("--stop: a stop string must not be empty")
    record = getattr(args, "record", None)
    if record is not None:
        from fxsched.runtime.cli.bounds import record_problem

        problem = record_problem(record, getattr(args, "force", False))
        if problem:
            raise UsageError(f"--record {record}: {problem}")
    choice = _model_choice(args, dflash=args.spec == "dflash")
    if batch > 16 and choice.model is not None and not choice.default:  # a checkpoint gets the slots asked
        choice = dataclasses.replace(choice, max_slots=batch)
    lora = _lora_choice(args)
    if lora is not None:
        if choice.model is None:
            raise UsageError("--lora: needs a Hugging Face checkpoint (--model DIR or the default model), not --weights")
        choice = dataclasses.replace(choice, max_loras=len(lora.adapters), max_lora_rank=lora.max_rank)
    _check_text_model(args, choice, option)
    if getattr(args, "overlap", False) and choice.ep_ranks > 1:
        raise UsageError(f"--overlap: the device lane does not run under expert parallelism (--ep-ranks {choice.ep_ranks})")
    if getattr(args, "async_scheduling", None) and choice.ep_ranks > 1:
        raise UsageError(f"--async-scheduling: not under expert parallelism (--ep-ranks {choice.ep_ranks}): its "
                         f"words carry every token to the workers")
    from fxsched.runtime.generate import GenerateError, TextOptions, check_prompt, expand_prompts

    sampling = _sampling(args)
    device = _torch_device(args.device)
    tokenizer = _tokenizer(args, choice)
    if stops and tokenizer is None:
        raise UsageError("--stop: stop strings need a tokenizer, and the model has none (give --tokenizer DIR)")
    prompts = _prompts(args, tokenizer)
    engine = _engine(choice, device)
    cfg = engine.cfg
    if batch > cfg.max_slots:
        raise UsageError(f"--batch {batch}: must be between 1 and {cfg.max_slots} (the model's slots)")
    try:
        for prompt in prompts:
            check_prompt(prompt.tokens, cfg, prompt.source)
    except GenerateError as err:
        raise UsageError(str(err)) from None
    _set_threads(args.threads, device, checkpoint=args.model is not None)
    token_lists = expand_prompts([p.tokens for p in prompts], batch)
    if lora is not None:
        _load_adapters(engine, lora)
    if args.ignore_eos:
        eos_ids: Optional[tuple[int, ...]] = ()
    elif tokenizer is not None and tokenizer.eos_ids:
        eos_ids = tokenizer.eos_ids
    else:
        eos_ids = None  # the model config's
    from fxsched.runtime.generate import GenerateInterrupted

    mode = "json" if args.json else ("text" if tokenizer is not None else "tokens")
    printer = Printer(out, mode, len(token_lists), think=tokenizer is not None and tokenizer.think_ids is not None)
    text = TextOptions(tokenizer, stops) if tokenizer is not None else None
    total = len(token_lists) * max_tokens
    bar = None
    if total >= PROGRESS_MIN_TOKENS and not args.no_progress and not printer.streaming:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="tok", desc=f"generate ({args.spec})", disable=None, leave=False)
    interrupted, failure = False, None
    from fxsched.runtime.interpreter import RunError

    try:
        from fxsched.runtime.cli.ep import generate_function

        run = generate_function(args)
        lane: dict[str, Any] = {"overlap": True} if getattr(args, "overlap", False) else {}
        if getattr(args, "async_scheduling", None) is not None and choice.ep_ranks <= 1:
            lane["async_scheduling"] = args.async_scheduling
        if lora is not None:
            lane["adapter_slots"] = [lora.slots[i % len(lora.slots)] for i in range(len(token_lists))]
            printer.adapters = {i + 1: lora.adapters[slot][0] if slot >= 0 else None
                                for i, slot in enumerate(lane["adapter_slots"])}
        result = run(engine, token_lists, max_tokens, args.spec, batch,
                     progress=bar.update if bar is not None else None, eos_ids=eos_ids, text=text,
                     on_text=printer.on_text, on_finish=printer.on_finish, sampling=sampling,
                     **_record_options(record, choice, prompts), **lane)
    except GenerateError as err:
        raise UsageError(str(err)) from None
    except GenerateInterrupted as stop:  # Ctrl-C: the unfinished requests were reported as "interrupted"
        result, interrupted = stop.result, True
    except RunError as err:  # an EP group that failed mid-run: what was generated until then, then the error
        if getattr(err, "result", None) is None:
            raise
        result, failure = err.result, str(err)  # type: ignore[attr-defined]
    finally:
        if bar is not None:
            bar.close()
    printer.finish(result)
    if failure is not None:
        print(f"fxsched generate: {failure}", file=sys.stderr)
        return EXIT_FAILED
    if interrupted:
        print("fxsched generate: interrupted (Ctrl-C); the output is what was generated until then",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if any(r.error for r in result.results) else 0


def _record_options(record: Optional[str], choice: ModelChoice, prompts: list) -> dict[str, Any]:
    """The ``generate`` keywords of ``--record`` (none without it): the path and the header's meta."""
    if record is None:
        return {}
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("fxsched")
    except PackageNotFoundError:
        release = "unknown"
    model = choice.model or choice.weights or "internal model (seeded)"
    return {"record": record, "record_meta": {"model": model, "prompts": len(prompts), "fxsched": release}}


def run_bench_generate(args, out=None) -> list[dict]:
    out = out or sys.stdout
    from fxsched.runtime.bench.generate import PROMPT_SETS, bench_generate, format_table, row_json
    from fxsched.runtime.generate import SPECS

    device = _torch_device(args.device)
    batches = [_int(b, "--batches", 1) for b in args.batches.split(",") if b.strip()]
    if not batches:
        raise UsageError(f"--batches {args.batches!r}: give batch sizes separated by commas, e.g. 1,4,16")
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    if not specs:
        raise UsageError(f"--specs {args.specs!r}: give speculation modes separated by commas, e.g. none,mtp")
    for spec in specs:
        if spec not in SPECS:
            raise UsageError(f"--specs {spec}: unknown speculation mode (choose from {', '.join(SPECS)})")
    max_tokens = _int(args.max_tokens, "--max-tokens", 1)
    temperature = _float(getattr(args, "bench_temperature", None) or "0", "--temperature")
    if not 0 <= temperature <= 100:
        raise UsageError(f"--temperature {args.bench_temperature}: must be between 0 and 100")
    sets = [s.strip() for s in getattr(args, "prompts", ",".join(PROMPT_SETS)).split(",") if s.strip()]
    for name in sets or [""]:
        if name not in PROMPT_SETS:
            raise UsageError(f"--prompts {name or args.prompts!r}: unknown prompt set (choose from "
                             f"{', '.join(PROMPT_SETS)})")
    from fxsched.runtime.bench.generate import OVERLAPS

    overlap = getattr(args, "bench_overlap", None) or "off"
    if overlap not in OVERLAPS:
        raise UsageError(f"--overlap {overlap}: choose from {', '.join(OVERLAPS)}")
    rounds = _int(getattr(args, "bench_rounds", None) or "3", "--rounds", 1)
    from fxsched.runtime.cli.ep import parse_ranks_list

    try:
        ranks = parse_ranks_list(getattr(args, "bench_ep_ranks", None) or "1")
    except ValueError as err:
        raise UsageError(f"--ep-ranks {err}") from None
    choice = _model_choice(args, dflash="dflash" in specs)
    tokenizer = _tokenizer(args, choice)
    engine = _engine(choice, device)  # validates the model once
    for b in batches:
        if b > engine.cfg.max_slots:
            raise UsageError(f"--batches {b}: must be between 1 and {engine.cfg.max_slots} (the model's slots)")
    experts = engine.cfg.num_experts if "moe" in engine.cfg.mlp_pattern else 0
    for n in ranks:
        if experts and n > experts:
            raise UsageError(f"--ep-ranks {n}: {choice.label} takes at most {experts} ranks ({experts} experts per "
                             f"MoE layer, at least one per rank)")
    _set_threads(None, device)
    from tqdm import tqdm

    bar = tqdm(desc="bench generate", unit="run", disable=None, leave=False)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update()

    try:
        from dataclasses import replace

        rows = bench_generate(lambda n=1: _engine(replace(choice, ep_ranks=n), device), batches, max_tokens, specs,
                              progress=progress, tokenizer=tokenizer, prompt_sets=sets, ep_ranks=ranks,
                              model_dir=choice.model, weights=choice.weights, temperature=temperature,
                              overlap=overlap, rounds=rounds)
    finally:
        bar.close()
    model = choice.model or choice.weights or "random (seeded)"
    label = "default model" if choice.default else ("model" if choice.model else "weights")
    if getattr(args, "json", False):
        for row in rows:
            record = {**row_json(row), "device": device, "max_tokens": max_tokens, "temperature": temperature,
                      "model": model}
            print(json.dumps(record), file=out)
        return rows
    print(f"bench generate: device={device} max_tokens={max_tokens} temperature={temperature:g} {label}={model}",
          file=out)
    print(format_table(rows), file=out)
    return rows
