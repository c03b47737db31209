"""The EP (expert-parallel) command words: the one place they are defined.

The leader sends 32-bit words on the EP command stream. A word from ``RESERVED_FROM`` up is a
command (prefill, release, a K-row verify, shutdown); a word below it is a token id decoded in
the slot the word was sent for.
"""

from __future__ import annotations

PREFILL_CMD = 0xFFFFFFF0
"""A prefill; chunk length, chunk start, full prompt length, the prompt and vision length follow."""

RELEASE_CMD = 0xFFFFFFF1
"""The slot's occupant is freed and the slot is allocated afresh (empty)."""

VERIFY_CMD: dict[int, int] = {2: 0xFFFFFFF2, 3: 0xFFFFFFF3, 4: 0xFFFFFFF4}
"""The word of a verify over K rows, by K; the K input tokens follow, then the accept count."""

VERIFY_K: dict[int, int] = {word: k for k, word in VERIFY_CMD.items()}
"""The K of each verify word (the inverse of ``VERIFY_CMD``)."""

SHUTDOWN_CMD = 0xFFFFFFFF
"""The workers stop."""

RESERVED_FROM = 0xFFFFFFF0
"""Words from here up are commands; words below are token ids."""
