"""Client frames against the device-call stream (specs/checker.md §11.2): what a client is sent
must come after the device work it stands on.

Two rules of order, and one of pairing:

The plain sink (specs/scheduler.md §5.17 step 4) checkpoints a sequence (``MarconiCheckpoint``,
``decode_marconi_checkpoint``) before it streams the token the checkpoint covers: a client that
has a token must be able to resume from a state that includes it. So in a batch that checkpoints
a sequence and streams its request's token, the frame comes after the checkpoint.

A rejected verify cuts the sequence's KV back to the accepted prefix (the commit of the accepted
prefix, a truncation or a rollback; specs/speculation.md §6.6, §6.14) before the correction is
streamed: a client that has the correction must never be ahead of a KV still holding the rejected
draft. So in a batch that cuts a sequence back after its last verify was rejected, its request's
token frames come after the cut.

And the plain sink checkpoints exactly the rows whose token it streams: a checkpoint of a streaming
request's sequence with no token frame in its batch checkpointed an EOS, cancelled or dropped row.
"""

from __future__ import annotations

from fxsched.effects import device_calls as dc
from fxsched.effects.client import TokenOut, TokensOut
from fxsched.effects.lifecycle import MarconiCheckpoint
from fxsched.runtime.check.violation import Violation


def _frames_of(effects, device, seqs):
    """(index, frame, its request's sequence) for each token frame of a request whose sequence is in
    ``seqs`` (the device's live sequences say which request each holds)."""
    rid, live = device._rid, device.live
    seq_of = {rid(live[s]): s for s in seqs if s in live}
    for at, effect in enumerate(effects):
        if isinstance(effect, (TokenOut, TokensOut)):
            seq = seq_of.get(effect.request_id)
            if seq is not None:
                yield at, effect, seq


def tokens_after_checkpoints(effects, device) -> None:
    """token after its checkpoint: in one batch (batched records expanded), no token frame of a
    request comes before the checkpoint of its sequence (the device's live sequences say which
    request each holds)."""
    checkpointed: dict[int, int] = {}  # seq id -> index of its first checkpoint in the batch
    for at, effect in enumerate(effects):
        if type(effect) is MarconiCheckpoint and effect.seq not in checkpointed:
            checkpointed[effect.seq] = at
    for at, effect, seq in _frames_of(effects, device, checkpointed) if checkpointed else ():
        if checkpointed[seq] > at:
            raise Violation("token_after_checkpoint", f"request {effect.request_id}'s token frame comes before the "
                                                          f"checkpoint of its sequence {seq} in the same batch")


def checkpoints_stream(effects, device, requests) -> None:
    """no checkpoint without its token: the plain sink checkpoints a row exactly when it streams
    its token (specs/scheduler.md §5.17 steps 3-4: an EOS row, a cancelled row and a dropped token
    are neither), so in one batch every checkpoint of a streaming request's sequence (``requests``:
    the run's, by id) is followed by a token frame of that request. (Only where nothing
    speculates: the caller says.)"""
    checkpointed = {effect.seq for effect in effects if type(effect) is MarconiCheckpoint}
    rid, live = device._rid, device.live
    owed = {s: rid(live[s]) for s in checkpointed if s in live}
    owed = {s: r for s, r in owed.items() if getattr(requests.get(r), "streaming", False)}
    if not owed:
        return
    streamed = {seq for _, _, seq in _frames_of(effects, device, owed)}
    for seq, request in owed.items():
        if seq not in streamed:
            raise Violation("checkpoint_has_token", f"sequence {seq} is checkpointed, but request {request} gets no "
                                                    f"token in the same batch (an EOS, cancelled or dropped row is "
                                                    f"never checkpointed)")


CUTS_ONE = (dc.CommitAcceptedPrefix, dc.TruncateSequence, dc.StartRollbackAndCheckpointAsync, dc.RollbackSsmStates,
            dc.TrimProposerState)
CUTS_MANY = (dc.CommitAcceptedPrefixBatch, dc.TruncateSequences, dc.TrimProposerStateBatch)
"""The effects that cut a sequence's KV back after a verify: one sequence (``seq``), or several (``seqs``)."""


def _rejected(device, seq: int) -> bool:
    """Whether the last verify of ``seq`` rejected one of its drafts (the simulated device's own count)."""
    accepted = device._accepted(seq)
    return accepted is not None and accepted < len(device.verify_io[seq][0]) - 1


def tokens_after_cut(effects, device) -> None:
    """correction after the cut: in one batch, no token frame of a request whose sequence's last
    verify was rejected comes before the truncation that cuts the sequence back; after a K = 2
    verify (``decode_verify_graphed``: MTP K = 2, n-gram), before none of the effects that cut it back
    (the commit of its accepted prefix, the trim, the rollback), which a reject orders first
    (specs/speculation.md §6.6, §6.14; a DFlash or K = 3/4 verdict commits after it emits)."""
    first: dict[int, int] = {}  # seq id -> index of the first effect that cuts it back
    last: dict[int, int] = {}  # and of the last
    for at, effect in enumerate(effects):
        if isinstance(effect, CUTS_ONE):
            first.setdefault(effect.seq, at)
            last[effect.seq] = at
        elif isinstance(effect, CUTS_MANY):
            for seq in effect.seqs:
                first.setdefault(seq, at)
                last[seq] = at
    for at, effect, cut in _frames_of(effects, device, first) if first else ():
        if not _rejected(device, cut):
            continue
        bound = last[cut] if device.last_forward.get(cut) == "decode_verify_graphed" else first[cut]
        if bound > at:
            raise Violation("correction_after_cut", f"request {effect.request_id}'s token frame comes before the "
                                                    f"cut-back of its sequence {cut}, whose verify was rejected")
