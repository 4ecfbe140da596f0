"""The sans-IO consensus: records, tally, the follower's rules and the state table."""

from __future__ import annotations

import contextlib
import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from kvtierd.pool.consensus import (
    FORMAT_VERSION,
    TRANSITIONS,
    Adopt,
    CastVote,
    Decision,
    GroupEvent,
    GroupKeys,
    GroupState,
    Proposal,
    RankState,
    RoundId,
    Vote,
    Wait,
    backoff_delay,
    decode_decision,
    decode_proposal,
    decode_vote,
    describe_decision,
    encode,
    judge,
    next_state,
    should_adopt,
    should_vote,
    tally,
)

rounds = st.builds(RoundId, st.integers(1, 2**63 - 1), st.text("0123456789abcdef", min_size=1))


def proposal(round_id: RoundId, world_size: int = 2, digest: str = "d") -> Proposal:
    return Proposal(FORMAT_VERSION, round_id, world_size, "redis://pool:6379/0", digest, 5.0)


def vote(round_id: RoundId, rank: int, yes: bool = True, voter: str = "v") -> Vote:
    return Vote(FORMAT_VERSION, round_id, rank, yes, "" if yes else f"no from {rank}", voter)


R1, R2 = RoundId(1, "aa"), RoundId(2, "bb")


# -- records -----------------------------------------------------------------------------------


@given(rounds, st.integers(1, 64), st.text(), st.text(), st.floats(0.01, 600))
def test_proposal_round_trips(round_id: RoundId, world: int, address: str, digest: str, t: float):
    record = Proposal(FORMAT_VERSION, round_id, world, address, digest, t)
    assert decode_proposal(encode(record)) == record


@given(rounds, st.integers(0, 64), st.booleans(), st.text(), st.text())
def test_vote_round_trips(round_id: RoundId, rank: int, yes: bool, reason: str, voter: str):
    record = Vote(FORMAT_VERSION, round_id, rank, yes, reason, voter)
    assert decode_vote(encode(record)) == record


@given(rounds, st.dictionaries(st.integers(0, 64), st.booleans(), max_size=8))
def test_decision_round_trips(round_id: RoundId, ballot: dict[int, bool]):
    votes = {rank: vote(round_id, rank, yes) for rank, yes in ballot.items()}
    record = tally(proposal(round_id, world_size=65), votes, 65, timed_out=True)
    assert record is not None
    assert decode_decision(encode(record)) == record


@given(st.binary())
def test_any_bytes_decode_or_raise_remote_protocol_error(data: bytes):
    for decode in (decode_proposal, decode_vote, decode_decision):
        with contextlib.suppress(RemoteProtocolError):
            decode(data)


def test_another_format_version_is_refused():
    future = msgspec.msgpack.encode([FORMAT_VERSION + 1, [1, "aa"], 2, "a", "d", 5.0])
    with pytest.raises(RemoteProtocolError, match="format version 2"):
        decode_proposal(future)
    with pytest.raises(RemoteProtocolError):
        decode_vote(encode(proposal(R1)))  # a proposal is not a vote


def test_keys_share_one_hash_tag():
    keys = GroupKeys("tp-7")
    names = [keys.epoch, keys.proposal, keys.decision, keys.round_requests, keys.votes(R1)]
    assert all(name.startswith("kvt:{tp-7}:") for name in names)
    assert keys.votes(R1) == "kvt:{tp-7}:votes:1:aa"
    assert GroupKeys("g", "x").epoch == "x:{g}:epoch"
    for bad in ("", "a{b", "a}b"):
        with pytest.raises(ConfigError):
            GroupKeys(bad)


# -- judging and tallying ----------------------------------------------------------------------


def test_judge_names_every_failed_check():
    p = proposal(R1, world_size=2, digest="3a" * 16)
    assert judge(p, rank=1, world_size=2, digest="3a" * 16, voter="v", probe_error=None).yes
    no = judge(p, rank=1, world_size=3, digest="9f" * 16, voter="v", probe_error="probe broke")
    assert not no.yes
    assert no.reason == (
        "probe broke; pool config digest 9f9f9f9f9f9f.. differs from the leader's "
        "3a3a3a3a3a3a..; world size 3 differs from the leader's 2"
    )
    assert (no.round, no.rank, no.voter) == (R1, 1, "v")


def test_world_size_mismatch_is_a_no():
    p = proposal(R1, world_size=2)
    v = judge(p, rank=1, world_size=4, digest="d", voter="v", probe_error=None)
    assert not v.yes
    assert v.reason == "world size 4 differs from the leader's 2"


def test_tally_waits_for_every_rank_then_decides():
    p = proposal(R1, world_size=3)
    votes = {0: vote(R1, 0), 1: vote(R1, 1)}
    assert tally(p, votes, 3, timed_out=False) is None
    votes[2] = vote(R1, 2)
    decision = tally(p, votes, 3, timed_out=False)
    assert decision is not None
    assert decision.attached
    assert decision.members == (0, 1, 2)
    assert decision.refusals == {}


def test_tally_names_missing_ranks_on_timeout():
    decision = tally(proposal(R1, world_size=3), {0: vote(R1, 0)}, 3, timed_out=True)
    assert decision is not None
    assert not decision.attached
    assert decision.missing == (1, 2)
    assert decision.refusals == {1: "did not vote within 5.0 s", 2: "did not vote within 5.0 s"}
    text = describe_decision("g", decision)
    assert text == (
        "group g stays local (epoch 1): rank 1 did not vote within 5.0 s; "
        "rank 2 did not vote within 5.0 s"
    )


def test_a_no_refuses_and_is_named():
    decision = tally(proposal(R1), {0: vote(R1, 0), 1: vote(R1, 1, yes=False)}, 2, False)
    assert decision is not None
    assert not decision.attached
    assert decision.members == (0,)
    assert (
        describe_decision("g", decision)
        == "group g stays local (epoch 1): rank 1 refused: no from 1"
    )


@given(
    st.dictionaries(
        st.integers(-2, 5),
        st.tuples(st.sampled_from([R1, R2]), st.integers(-2, 5), st.booleans()),
        max_size=8,
    ),
    st.booleans(),
)
def test_stale_and_misfiled_votes_never_count(
    ballot: dict[int, tuple[RoundId, int, bool]], timed_out: bool
):
    """Only a vote for this round, filed under its own rank, of a rank in the group, counts."""
    world = 3
    votes = {field: vote(rid, rank, yes) for field, (rid, rank, yes) in ballot.items()}
    valid = {f: v for f, v in votes.items() if v.round == R2 and v.rank == f and 0 <= f < world}
    decision = tally(proposal(R2, world_size=world), votes, world, timed_out)
    if decision is None:
        assert not timed_out
        assert len(valid) < world
        return
    assert decision.round == R2
    assert set(decision.voters) == set(valid)
    assert decision.members == tuple(sorted(f for f, v in valid.items() if v.yes))
    assert decision.attached == (len(valid) == world and all(v.yes for v in valid.values()))
    assert set(decision.refusals) == set(range(world)) - set(decision.members)


# -- the follower's rules ----------------------------------------------------------------------


def decided(round_id: RoundId, attached: bool = True, voters: dict[int, str] | None = None):
    return Decision(
        FORMAT_VERSION,
        round_id,
        attached,
        (0, 1) if attached else (0,),
        {} if attached else {1: "no"},
        (),
        voters if voters is not None else {0: "l", 1: "me"},
    )


def test_should_vote():
    assert should_vote(proposal(R1), None, None)
    assert not should_vote(None, None, None)
    assert not should_vote(proposal(R1), None, R1)  # never twice in one round
    assert not should_vote(proposal(R1), decided(R1), None)  # a closed round
    assert should_vote(proposal(R2), decided(R1), R1)  # a restarted leader's new proposal


def test_should_adopt():
    kw = {"rank": 1, "voter": "me"}
    assert should_adopt(decided(R1), awaiting=R1, **kw)
    assert not should_adopt(decided(R1), awaiting=R2, **kw)  # another proposal's decision
    assert not should_adopt(decided(R1), awaiting=None, **kw)  # not waiting (reconnected)
    assert not should_adopt(None, awaiting=R1, **kw)
    predecessor = decided(R1, voters={0: "l", 1: "old process"})
    assert not should_adopt(predecessor, awaiting=R1, **kw)  # its yes, not ours
    assert should_adopt(decided(R1, attached=False, voters={}), awaiting=R1, **kw)


@given(
    st.one_of(st.none(), st.sampled_from([R1, R2])),
    st.one_of(st.none(), st.sampled_from([R1, R2])),
    st.one_of(st.none(), st.sampled_from([R1, R2])),
    st.one_of(st.none(), st.sampled_from([R1, R2])),
    st.booleans(),
    st.sampled_from(["me", "other"]),
)
def test_next_step_follows_the_rules(
    proposed: RoundId | None,
    decided_round: RoundId | None,
    voted_for: RoundId | None,
    awaiting: RoundId | None,
    attached: bool,
    counted_voter: str,
):
    state = fresh(rank=1)
    state.voted_for, state.awaiting = voted_for, awaiting
    p = proposal(proposed) if proposed else None
    d = decided(decided_round, attached, {1: counted_voter}) if decided_round else None
    step = state.next_step(p, d)
    if should_vote(p, d, voted_for):
        assert step == CastVote(p)  # type: ignore[arg-type]
    elif should_adopt(d, rank=1, voter="me", awaiting=awaiting):
        assert step == Adopt(d)  # type: ignore[arg-type]
    else:
        assert step == Wait()
    if isinstance(step, Adopt):
        assert step.decision.round == awaiting


# -- one rank's state --------------------------------------------------------------------------


def fresh(rank: int = 1) -> RankState:
    return RankState.initial(group_id="g", rank=rank, world_size=2, digest="d", voter="me", now=0)


def test_state_table_is_exhaustive_and_illegal_pairs_raise():
    for state, event in itertools.product(GroupState, GroupEvent):
        if (state, event) in TRANSITIONS:
            assert next_state(state, event) is TRANSITIONS[(state, event)]
        else:
            with pytest.raises(LocalProtocolError):
                next_state(state, event)
    assert next_state(GroupState.ATTACHED, GroupEvent.ROUND_JOINED) is GroupState.VOTING
    assert all(TRANSITIONS[(s, GroupEvent.POOL_LOST)] is GroupState.LOCAL for s in GroupState)
    # only a decision attaches
    attaching = {k for k, v in TRANSITIONS.items() if v is GroupState.ATTACHED}
    assert {event for _, event in attaching} == {GroupEvent.DECIDED_ATTACHED}


def test_initial_state_is_local_and_ranks_are_checked():
    assert fresh().status.state is GroupState.LOCAL
    with pytest.raises(ConfigError):
        RankState.initial(group_id="g", rank=2, world_size=2, digest="d", voter="v", now=0)


def test_vote_then_adopt_attaches():
    state = fresh()
    v = state.vote_on(proposal(R1), None, now=10, clock=100)
    assert v.yes
    assert (state.status.state, state.status.changed_at) == (GroupState.VOTING, 10)
    assert state.adopt(decided(R1), now=11)
    status = state.status
    assert (status.state, status.reason, status.epoch, status.nonce) == ("attached", "", 1, "aa")
    assert status.members == (0, 1)
    assert state.awaiting is None


def test_refusal_is_adopted_with_its_reasons():
    state = fresh()
    state.vote_on(proposal(R1), None, now=1, clock=1)
    state.adopt(decided(R1, attached=False), now=2)
    assert state.status.state is GroupState.LOCAL
    assert state.status.refusals == {1: "no"}
    assert "rank 1 refused: no" in state.status.reason


def test_a_decision_for_another_round_is_not_adopted():
    state = fresh()
    state.vote_on(proposal(R2), None, now=1, clock=1)
    assert state.next_step(proposal(R2), decided(R1)) == Wait()
    with pytest.raises(LocalProtocolError):
        state.adopt(decided(R1), now=2)
    assert state.status.state is GroupState.VOTING


def test_a_restarted_leaders_proposal_supersedes():
    state = fresh()
    state.vote_on(proposal(R1), None, now=1, clock=1)
    # the old leader's decision is there too, but the new proposal wins
    step = state.next_step(proposal(R2), decided(R1))
    assert step == CastVote(proposal(R2))
    state.vote_on(proposal(R2), None, now=2, clock=2)
    assert state.next_step(proposal(R2), decided(R1)) == Wait()
    assert state.next_step(proposal(R2), decided(R2)) == Adopt(decided(R2))


def test_pool_loss_makes_local_and_forgets_the_awaited_round():
    state = fresh()
    state.vote_on(proposal(R1), None, now=1, clock=1)
    assert state.pool_lost("pool unreachable: x", now=2)
    assert (state.status.state, state.status.reason) == (GroupState.LOCAL, "pool unreachable: x")
    # the round it voted in is decided meanwhile: neither re-voted nor adopted
    assert state.next_step(proposal(R1), decided(R1)) == Wait()
    assert state.next_step(proposal(R1), None) == Wait()


def test_pool_loss_keeps_the_last_decision_on_record():
    state = fresh()
    state.vote_on(proposal(R1), None, now=1, clock=1)
    state.adopt(decided(R1), now=2)
    state.pool_lost("pool restarted", now=3)
    assert (state.status.epoch, state.status.members, state.status.changed_at) == (1, (0, 1), 3)


def test_overdue_decision_turns_local_then_late_decision_still_attaches():
    state = fresh()
    state.vote_on(proposal(R1), None, now=1, clock=100)  # vote_timeout_s 5
    assert not state.decision_overdue(now=2, clock=106, grace_s=2)
    assert state.decision_overdue(now=3, clock=108, grace_s=2)
    assert state.status.state is GroupState.LOCAL
    assert "no decision from the leader" in state.status.reason
    assert not state.decision_overdue(now=4, clock=200, grace_s=2)  # once
    assert state.adopt(decided(R1), now=5)
    assert state.status.state is GroupState.ATTACHED


def test_abandon_forgets_the_round():
    state = fresh(rank=0)
    state.voter = "l"
    state.vote_on(proposal(R1), None, now=1, clock=1)
    state.abandon("superseded", now=2)
    assert (state.status.state, state.awaiting) == (GroupState.LOCAL, None)


def test_vote_on_with_probe_error_is_a_no_but_still_voting():
    state = fresh()
    v = state.vote_on(proposal(R1), "probe failed", now=1, clock=1)
    assert (v.yes, v.reason) == (False, "probe failed")
    assert state.status.state is GroupState.VOTING


@given(st.integers(0, 100), st.floats(0, 1, exclude_max=True))
def test_backoff_grows_and_stays_within_bounds(attempt: int, jitter: float):
    delay = backoff_delay(attempt, 0.1, 5.0, jitter)
    assert 0.05 <= delay <= 5.0
    assert backoff_delay(attempt, 0.1, 5.0, 0.0) <= backoff_delay(attempt + 1, 0.1, 5.0, 0.0)
