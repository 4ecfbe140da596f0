"""Sans-IO TP-group consensus: the messages, the keys, the tally and one rank's state.

Theory of operation. The ranks of a TP group decide together whether to attach to the shared pool;
the pool itself is the rendezvous. Rank 0 leads. A *round* is identified by a :class:`RoundId`:
an epoch from ``INCR`` on the group's epoch counter plus a random nonce. The counter alone would
not do: a pool that lost its data restarts the counter, and an epoch seen before would look new
again; the nonce makes every round's identity fresh whatever the pool remembers. Nothing compares
round ids for order: a rank only asks "is this the round I voted in?".

1. The leader writes a :class:`Proposal` (round, world size, pool address, config digest).
2. Every rank, leader included, that sees a proposal for a round it has not voted in, and that the
   leader has not already decided, checks it (:func:`judge`: the write/read probe, the digest, the
   world size) and writes a :class:`Vote` into a hash whose key names the round.
3. The leader reads that hash until :func:`tally` has a vote from every rank or the vote timeout
   passed, and writes the :class:`Decision`: attached only if every rank voted yes.
4. A rank adopts a decision only for the round it is waiting on (:func:`should_adopt`), and an
   attaching decision only if the vote it counted is this rank's own (a vote carries a per-process
   ``voter`` id), so a restarted rank never inherits its predecessor's yes.

Why stale input never counts: a vote sits under a key that names its round *and* carries the round
inside; :func:`tally` counts a vote only if both match the proposal being tallied and the hash field
matches the vote's rank. A decision names its round; a rank that waits on another round ignores it.
A rank that reconnects to the pool stops waiting on any earlier round (:meth:`RankState.pool_lost`)
and asks for a new one instead.

:class:`RankState` is one rank's bookkeeping; :data:`TRANSITIONS` is the table of legal state
changes. Nothing here awaits, reads a clock (callers pass ``now``) or touches the network:
:mod:`kvtierd.pool.group` carries the decisions out against the pool.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Final, TypeVar

import msgspec

from kvtierd.errors import ConfigError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "FORMAT_VERSION",
    "TRANSITIONS",
    "Adopt",
    "CastVote",
    "Decision",
    "GroupEvent",
    "GroupKeys",
    "GroupState",
    "GroupStatus",
    "Proposal",
    "RankState",
    "RoundId",
    "Step",
    "Vote",
    "Wait",
    "backoff_delay",
    "decode_decision",
    "decode_proposal",
    "decode_vote",
    "describe_decision",
    "encode",
    "judge",
    "next_state",
    "should_adopt",
    "should_vote",
    "tally",
]

#: Version of the records below; a record of another version is unreadable, never guessed at.
FORMAT_VERSION: Final = 1

#: Digests are shown shortened in reasons and logs: enough to tell two configurations apart.
_DIGEST_SHOWN: Final = 12


class GroupState(enum.StrEnum):
    """Where a rank stands. Anything but ``ATTACHED`` means: serve from the local tiers only."""

    LOCAL = "local"
    VOTING = "voting"
    ATTACHED = "attached"


class GroupEvent(enum.Enum):
    """What moves a rank between states (see :data:`TRANSITIONS`)."""

    ROUND_JOINED = enum.auto()  # voted in (or, as leader, proposed) a round
    DECIDED_ATTACHED = enum.auto()  # adopted a unanimous decision of the awaited round
    DECIDED_LOCAL = enum.auto()  # adopted a refusing decision of the awaited round
    ROUND_ABANDONED = enum.auto()  # voted, and no decision came in time (or was superseded)
    POOL_LOST = enum.auto()  # the pool failed, restarted or was never reached


_S = GroupState
_E = GroupEvent

#: (state, event) -> next state. A pair not in the table is a bug in the caller.
TRANSITIONS: Final[Mapping[tuple[GroupState, GroupEvent], GroupState]] = {
    **{(state, _E.ROUND_JOINED): _S.VOTING for state in GroupState},
    **{(state, _E.POOL_LOST): _S.LOCAL for state in GroupState},
    (_S.VOTING, _E.DECIDED_ATTACHED): _S.ATTACHED,
    (_S.VOTING, _E.DECIDED_LOCAL): _S.LOCAL,
    (_S.VOTING, _E.ROUND_ABANDONED): _S.LOCAL,
    # A decision may arrive after this rank stopped waiting (overdue); it is still the awaited one.
    (_S.LOCAL, _E.DECIDED_ATTACHED): _S.ATTACHED,
    (_S.LOCAL, _E.DECIDED_LOCAL): _S.LOCAL,
}


def next_state(state: GroupState, event: GroupEvent) -> GroupState:
    """The state after ``event``; raises :class:`LocalProtocolError` for an illegal pair."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(f"group event {event.name} is illegal in state {state}") from None


# -- records -----------------------------------------------------------------------------------


class RoundId(msgspec.Struct, array_like=True, frozen=True):
    """One round's identity: the epoch counter's value and a random nonce."""

    epoch: int
    nonce: str

    def __str__(self) -> str:
        return f"{self.epoch}:{self.nonce}"


class Proposal(msgspec.Struct, array_like=True, frozen=True):
    """What the leader asks the group to agree on."""

    version: int
    round: RoundId
    world_size: int
    address: str  # shown to operators; not voted on (hosts may name one pool differently)
    digest: str
    vote_timeout_s: float


class Vote(msgspec.Struct, array_like=True, frozen=True):
    """One rank's answer to one proposal; ``reason`` says why not ("" for yes)."""

    version: int
    round: RoundId
    rank: int
    yes: bool
    reason: str
    voter: str  # random per process: tells this rank's vote from its predecessor's


class Decision(msgspec.Struct, array_like=True, frozen=True):
    """The leader's verdict on one round."""

    version: int
    round: RoundId
    attached: bool
    members: tuple[int, ...]  # ranks that voted yes
    refusals: dict[int, str]  # rank -> why not, missing ranks included
    missing: tuple[int, ...]  # ranks with no vote in time
    voters: dict[int, str]  # rank -> voter id of the vote counted


_ENCODER = msgspec.msgpack.Encoder()
_PROPOSAL = msgspec.msgpack.Decoder(Proposal)
_VOTE = msgspec.msgpack.Decoder(Vote)
_DECISION = msgspec.msgpack.Decoder(Decision)


def encode(record: Proposal | Vote | Decision) -> bytes:
    """The MessagePack bytes stored in the pool."""
    return _ENCODER.encode(record)


_Record = TypeVar("_Record", Proposal, Vote, Decision)


def _decode(decoder: msgspec.msgpack.Decoder[_Record], data: bytes) -> _Record:
    try:
        record = decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"unreadable group record: {exc}") from None
    if record.version != FORMAT_VERSION:
        raise RemoteProtocolError(
            f"group record of format version {record.version}; this daemon reads {FORMAT_VERSION}"
        )
    return record


def decode_proposal(data: bytes) -> Proposal:
    """Raises :class:`RemoteProtocolError` for bytes that are not a proposal of this version."""
    return _decode(_PROPOSAL, data)


def decode_vote(data: bytes) -> Vote:
    """Raises :class:`RemoteProtocolError` for bytes that are not a vote of this version."""
    return _decode(_VOTE, data)


def decode_decision(data: bytes) -> Decision:
    """Raises :class:`RemoteProtocolError` for bytes that are not a decision of this version."""
    return _decode(_DECISION, data)


@dataclass(frozen=True, slots=True)
class GroupKeys:
    """The group's keys. They share the hash tag ``{group_id}``: one Redis Cluster slot."""

    group_id: str
    prefix: str = "kvt"

    def __post_init__(self) -> None:
        if not self.group_id or any(c in self.group_id for c in "{}"):
            raise ConfigError(f"group id {self.group_id!r} must be non-empty, without braces")

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{{{self.group_id}}}:{name}"

    @property
    def epoch(self) -> str:
        return self._key("epoch")

    @property
    def proposal(self) -> str:
        return self._key("proposal")

    @property
    def decision(self) -> str:
        return self._key("decision")

    @property
    def round_requests(self) -> str:
        return self._key("round_requests")

    def votes(self, round_id: RoundId) -> str:
        return self._key(f"votes:{round_id}")


# -- rules -------------------------------------------------------------------------------------


def _short(digest: str) -> str:
    return digest[:_DIGEST_SHOWN] + (".." if len(digest) > _DIGEST_SHOWN else "")


def judge(
    proposal: Proposal,
    *,
    rank: int,
    world_size: int,
    digest: str,
    voter: str,
    probe_error: str | None,
) -> Vote:
    """This rank's vote on ``proposal``. ``probe_error`` is why the write/read probe failed, or
    ``None`` when it passed. Every failed check is named, in a fixed order."""
    reasons: list[str] = []
    if probe_error is not None:
        reasons.append(probe_error)
    if digest != proposal.digest:
        mine, theirs = _short(digest), _short(proposal.digest)
        reasons.append(f"pool config digest {mine} differs from the leader's {theirs}")
    if world_size != proposal.world_size:
        reasons.append(f"world size {world_size} differs from the leader's {proposal.world_size}")
    return Vote(
        version=FORMAT_VERSION,
        round=proposal.round,
        rank=rank,
        yes=not reasons,
        reason="; ".join(reasons),
        voter=voter,
    )


def tally(
    proposal: Proposal, votes: Mapping[int, Vote], world_size: int, timed_out: bool
) -> Decision | None:
    """The decision on ``proposal`` from the votes read so far, or ``None`` to keep waiting.

    ``votes`` maps the hash field (a rank) to the vote stored there. A vote counts only if it is
    for this proposal's round, from the rank its field names, and that rank is in the group. The
    decision waits for every rank (so it can name every refusal) unless ``timed_out``; then each
    missing rank is refused with "did not vote within N s".
    """
    counted = {
        rank: vote
        for rank, vote in votes.items()
        if 0 <= rank < world_size and vote.rank == rank and vote.round == proposal.round
    }
    missing = tuple(rank for rank in range(world_size) if rank not in counted)
    if missing and not timed_out:
        return None
    refusals = {rank: vote.reason or "voted no" for rank, vote in counted.items() if not vote.yes}
    for rank in missing:
        refusals[rank] = f"did not vote within {proposal.vote_timeout_s:.1f} s"
    return Decision(
        version=FORMAT_VERSION,
        round=proposal.round,
        attached=not refusals,
        members=tuple(sorted(rank for rank, vote in counted.items() if vote.yes)),
        refusals=dict(sorted(refusals.items())),
        missing=missing,
        voters={rank: counted[rank].voter for rank in sorted(counted)},
    )


def should_vote(
    proposal: Proposal | None, decision: Decision | None, voted_for: RoundId | None
) -> bool:
    """Vote on ``proposal`` unless it is the round last voted in, or its round is decided
    already (a closed round: the leader no longer counts, so wait for the next one)."""
    if proposal is None or proposal.round == voted_for:
        return False
    return decision is None or decision.round != proposal.round


def should_adopt(
    decision: Decision | None, *, rank: int, voter: str, awaiting: RoundId | None
) -> bool:
    """Adopt ``decision`` only for the awaited round; an attaching one only if it counted this
    process's own vote. Staying local is always safe, so any refusal of that round is adopted."""
    if decision is None or awaiting is None or decision.round != awaiting:
        return False
    return not decision.attached or decision.voters.get(rank) == voter


def backoff_delay(attempt: int, low_s: float, high_s: float, jitter: float) -> float:
    """The wait before retry number ``attempt`` (from 0): ``low_s * 2**attempt`` capped at
    ``high_s``, then scaled into its upper half by ``jitter`` in [0, 1) so that ranks which failed
    together do not retry in step."""
    base = min(high_s, low_s * 2.0 ** min(attempt, 64))
    return base * (0.5 + 0.5 * jitter)


def describe_decision(group_id: str, decision: Decision) -> str:
    """The log line of an outcome, naming every rank that refused and why."""
    round_id = f"epoch {decision.round.epoch}"
    if decision.attached:
        members = ", ".join(str(rank) for rank in decision.members)
        return f"group {group_id} attached to the pool ({round_id}, ranks {members})"
    parts = [
        f"rank {rank} {reason}" if rank in decision.missing else f"rank {rank} refused: {reason}"
        for rank, reason in decision.refusals.items()
    ]
    return f"group {group_id} stays local ({round_id}): " + "; ".join(parts)


# -- one rank's state --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """A snapshot of one rank's membership, for the store, logs and ``kvtierctl pool status``."""

    state: GroupState
    reason: str  # why local ("" when attached)
    epoch: int  # of the last decision this rank took part in (0: none)
    members: tuple[int, ...]  # ranks that voted yes in that decision
    refusals: dict[int, str]  # rank -> reason, from that decision
    changed_at: float  # time.time() of the last state change
    nonce: str = ""  # the nonce of that decision's round: epochs repeat when a pool loses its data


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do until the pool shows something new."""


@dataclass(frozen=True, slots=True)
class CastVote:
    """Check ``proposal`` (run the probe) and write :meth:`RankState.vote_on`'s result."""

    proposal: Proposal


@dataclass(frozen=True, slots=True)
class Adopt:
    """Take ``decision`` (:meth:`RankState.adopt`)."""

    decision: Decision


Step = Wait | CastVote | Adopt


@dataclass(slots=True)
class RankState:
    """One rank's consensus bookkeeping, sans-IO; the I/O layer owns one per process.

    ``voted_for`` survives reconnects (a rank never votes twice in one round); ``awaiting``, the
    round whose decision this rank would adopt, does not.
    """

    group_id: str
    rank: int
    world_size: int
    digest: str
    voter: str
    status: GroupStatus
    voted_for: RoundId | None = None
    awaiting: RoundId | None = None
    voted_at: float = 0.0
    vote_timeout_s: float = 0.0

    @classmethod
    def initial(
        cls, *, group_id: str, rank: int, world_size: int, digest: str, voter: str, now: float
    ) -> RankState:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}")
        status = GroupStatus(GroupState.LOCAL, "not connected to the pool yet", 0, (), {}, now)
        return cls(group_id, rank, world_size, digest, voter, status)

    def _move(
        self, event: GroupEvent, reason: str, now: float, decision: Decision | None = None
    ) -> bool:
        """Apply ``event`` (and ``decision``'s record); returns whether the state changed."""
        old = self.status
        state = next_state(old.state, event)
        changed_at = now if state is not old.state else old.changed_at
        if decision is None:
            self.status = replace(old, state=state, reason=reason, changed_at=changed_at)
        else:
            self.status = GroupStatus(
                state,
                reason,
                epoch=decision.round.epoch,
                members=decision.members,
                refusals=dict(decision.refusals),
                changed_at=changed_at,
                nonce=decision.round.nonce,
            )
        return state is not old.state

    def pool_lost(self, reason: str, now: float) -> bool:
        """The pool failed or restarted: local, and no earlier round's decision is adopted."""
        self.awaiting = None
        return self._move(GroupEvent.POOL_LOST, reason, now)

    def next_step(self, proposal: Proposal | None, decision: Decision | None) -> Step:
        """A follower's move given what the pool holds now; a newer proposal comes first."""
        if proposal is not None and should_vote(proposal, decision, self.voted_for):
            return CastVote(proposal)
        if decision is not None and should_adopt(
            decision, rank=self.rank, voter=self.voter, awaiting=self.awaiting
        ):
            return Adopt(decision)
        return Wait()

    def vote_on(
        self, proposal: Proposal, probe_error: str | None, *, now: float, clock: float
    ) -> Vote:
        """Join ``proposal``'s round: state VOTING, and the vote to write. ``now`` is wall time
        (for the status), ``clock`` a monotonic clock (for :meth:`decision_overdue`)."""
        self.voted_for = self.awaiting = proposal.round
        self.voted_at = clock
        self.vote_timeout_s = proposal.vote_timeout_s
        self._move(GroupEvent.ROUND_JOINED, f"voting in round epoch {proposal.round.epoch}", now)
        return judge(
            proposal,
            rank=self.rank,
            world_size=self.world_size,
            digest=self.digest,
            voter=self.voter,
            probe_error=probe_error,
        )

    def adopt(self, decision: Decision, now: float) -> bool:
        """Take the awaited round's decision; raises :class:`LocalProtocolError` for another."""
        if not should_adopt(decision, rank=self.rank, voter=self.voter, awaiting=self.awaiting):
            raise LocalProtocolError(f"decision for round {decision.round} is not adoptable")
        self.awaiting = None
        event = GroupEvent.DECIDED_ATTACHED if decision.attached else GroupEvent.DECIDED_LOCAL
        reason = "" if decision.attached else describe_decision(self.group_id, decision)
        return self._move(event, reason, now, decision)

    def decision_overdue(self, *, now: float, clock: float, grace_s: float) -> bool:
        """Whether this rank voted more than the round's timeout plus ``grace_s`` ago (on the
        monotonic ``clock``) and no decision came; if so it turns local, and still adopts that
        round's decision should it come later."""
        if self.status.state is not GroupState.VOTING or self.awaiting is None:
            return False
        waited = clock - self.voted_at
        if waited < self.vote_timeout_s + grace_s:
            return False
        reason = f"no decision from the leader (rank 0) {waited:.1f} s after voting"
        return self._move(GroupEvent.ROUND_ABANDONED, reason, now)

    def abandon(self, reason: str, now: float) -> bool:
        """Give up the awaited round for good (the leader saw its proposal superseded)."""
        self.awaiting = None
        return self._move(GroupEvent.ROUND_ABANDONED, reason, now)
