"""Client frames against the device-call stream (specs/checker.md §11.2): what a client is sent
must come after the device work it stands on.

The plain sink (specs/scheduler.md §5.17 step 4) checkpoints a sequence (``MarconiCheckpoint``,
``decode_marconi_checkpoint``) before it streams the token the checkpoint covers: a client that
has a token must be able to resume from a state that includes it. So in a batch that checkpoints
a sequence and streams its request's token, the frame comes after the checkpoint.
"""

from __future__ import annotations

from fxsched.effects.client import TokenOut, TokensOut
from fxsched.effects.lifecycle import MarconiCheckpoint
from fxsched.runtime.check.violation import Violation


def tokens_after_checkpoints(effects, device) -> None:
    """token after its checkpoint: in one batch (batched records expanded), no token frame of a
    request comes before the checkpoint of its sequence (the device's live sequences say which
    request each holds)."""
    checkpointed: dict[int, int] = {}  # seq id -> index of its first checkpoint in the batch
    for at, effect in enumerate(effects):
        if type(effect) is MarconiCheckpoint and effect.seq not in checkpointed:
            checkpointed[effect.seq] = at
    if not checkpointed:
        return
    rid = device._rid
    live = device.live
    seq_of = {rid(live[s]): s for s in checkpointed if s in live}
    for at, effect in enumerate(effects):
        if isinstance(effect, (TokenOut, TokensOut)):
            seq = seq_of.get(effect.request_id)
            if seq is not None and checkpointed[seq] > at:
                raise Violation("token_after_checkpoint", f"request {effect.request_id}'s token frame comes before the "
                                                          f"checkpoint of its sequence {seq} in the same batch")
