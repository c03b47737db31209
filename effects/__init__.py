"""The vocabulary of fxsched: what the pure core asks the world to do.

Four kinds of frozen records, none holding callables, buffers or device handles:

- ``device_calls``: one record per call of the model-call boundary (``prefill``, ``decode_batch``,
  ``decode_verify_batched``, ``commit_ctx``, ...). A device renders its own trace line for them.
  The records live in one module per family (``call_base``, ``loop_calls``, ``sequence_calls``,
  ``adapter_calls``, ``ep_calls``, ``forward_calls``, ``readback_calls``, ``verify_calls``,
  ``speculation_calls``, ``batched_calls``); ``device_calls`` is their namespace.
- ``plans``: step plans (``Decode{...}``) the interpreter announces with ``fx launch <label>`` and
  expands into several device calls.
- ``lifecycle``: effects announced with ``fx apply <label>`` (``ReleaseSeq``, ``CompactSlot``,
  ``Quiesce``, ``EpShutdown``, ...), plus the ``fx lora`` and ``fx teardown`` commands.
- ``client``: what a client receives (tokens, ``Done``, ``Response``, ``Error``) and rotation acks.

An effect whose class sets ``QUERY = True`` is a query: the interpreter turns its answer into the
next event. Every batch of effects returned by ``step`` ends with exactly one query, except the
last batch of a run (shutdown), which ends with ``Teardown``.
"""

from .base import Effect, is_query

__all__ = ["Effect", "is_query"]
