"""The output of ``fxsched generate`` on stdout (``Printer``).

Output on stdout. Without a tokenizer: each request's token ids and a summary line. With one:
a single request's text is streamed as it is generated (flushed piece by piece, whether or not
stdout is a terminal), followed by a status line; with several requests each one's status line
and text are printed when it finishes. ``--json``: one JSON object per request and line, as each
finishes (``RequestResult.to_json``: ``index``, ``token_ids``, ``text``, ``finish_reason``, the
counters), then one summary object (``"summary": true``), and nothing else.
"""

from __future__ import annotations

import json
from typing import Optional


class Printer:
    """Writes a run's results to ``out`` as the chosen mode asks (see the module docstring)."""

    def __init__(self, out, mode: str, count: int, think: bool = False):
        self.out, self.mode, self.count, self.think = out, mode, count, think
        self.streaming = mode == "text" and count == 1
        self._ended_with_newline = True
        self.adapters: dict[int, Optional[str]] = {}  # request id -> its --lora adapter's name (None: base)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def on_text(self, request_id: int, piece: str) -> None:
        if self.streaming:
            self._write(piece)
            self._ended_with_newline = piece.endswith("\n")

    def on_finish(self, result) -> None:
        if self.mode == "json":
            record = result.to_json(result.id - 1)
            if self.adapters:
                record["lora"] = self.adapters.get(result.id)
            self._write(json.dumps(record, ensure_ascii=False) + "\n")
        elif self.mode == "text" and self.streaming:
            self._write(("" if self._ended_with_newline else "\n") + result.render_header(self.think) + "\n")
        elif self.mode == "text":
            text = result.text or ""
            self._write(result.render_header(self.think) + "\n" + text + ("" if text.endswith("\n") else "\n"))

    def finish(self, result) -> None:
        if self.mode == "tokens":
            for r in result.results:
                print(r.render(), file=self.out)
        if self.mode == "json":
            self._write(json.dumps(result.summary.to_json()) + "\n")
        else:
            print(result.summary.line(), file=self.out)
