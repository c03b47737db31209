"""What the routes beyond completions and chat share with the app's own (``Served``): the engine,
the limits, the drain state, the body screen and the submit path (specs/serve.md §12.5–7). Its own
module so that runtime/serve/routes_extra.py and runtime/serve/responses.py both take it without
importing each other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import Response

from fxsched.runtime.serve.choices import ChoiceEvent
from fxsched.runtime.serve.engine import ServeEngine
from fxsched.runtime.serve.guard import Screen
from fxsched.runtime.serve.protocol import Limits, Plan
from fxsched.runtime.serve.tools import ToolPlan


@dataclass(frozen=True)
class Served:
    """What the extra routes share with the app's own (runtime/serve/app.py ``create_app``)."""

    engine: ServeEngine
    limits: Limits
    state: Any  # app.ServeState: ``draining``, ``active`` (the drain waits for it)
    screen: Screen
    # (plan, loop, the response's id for the request's log record) -> the choice ids and their events
    submit: Callable[[Plan, asyncio.AbstractEventLoop, str], tuple[list[int], "asyncio.Queue[ChoiceEvent]"]]
    constrained: Callable[[Any, Plan, Optional[ToolPlan]], Awaitable[Plan]]
    unknown: Callable[[str], Callable[[list[str]], None]]
    event_stream: Callable[[AsyncIterator[str], Callable[[], None]], Response]
    disconnected: Callable[[Request], Awaitable[None]]
