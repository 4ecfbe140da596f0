"""One rank's membership of its TP group's pool attachment: the consensus carried out on the pool.

Theory of operation. :class:`GroupMembership.run` owns one pool client at a time. It connects
(the caller's ``connect`` factory, retried with exponential back-off and jitter), then drives the
sans-IO :class:`~kvtierd.pool.consensus.RankState` with one loop of *ticks* every
``heartbeat_s / 4``:

* rank 0 (the leader) starts a round when it has just connected, when the group's round-request
  counter moved (a follower connected), or, after a refusal, when its back-off has passed; while
  a round is open each tick reads the votes and :func:`~kvtierd.pool.consensus.tally` decides;
* every other rank asks for a round when it connects (``INCR`` on the counter), then each tick
  reads the proposal and the decision and does what :meth:`RankState.next_step` says: vote (after
  running the caller's ``probe``), adopt, or wait; it asks again when a decision attached the
  group without counting this process's vote;
* when a round attaches, the leader takes the counter as read after the votes as served: every
  request before it came from a rank counted in the round or one that will ask again, so a
  follower that connected just after the proposal does not cause a second round;
* every ``heartbeat_s`` a rank asks the server for its run id. An error, no reply within
  :attr:`op_timeout_s`, or a different run id (the server restarted: redis-py reconnects under us,
  so a restart can be invisible otherwise) means the pool was lost: the rank turns LOCAL, closes
  the client, and connects afresh, which starts a new round.

Every pool command runs under a timeout, so a dead pool can only make a rank local, never stall
it. Only pool failures are absorbed (logged, retried); a bug raises. The store treats any state
but ATTACHED as local, so VOTING is as safe as LOCAL.

redis-py's asyncio client needs asyncio underneath; the code uses anyio's API like the rest of the
daemon (the daemon refuses a pool under trio).
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis.asyncio.cluster import RedisCluster

from kvtierd.errors import ConfigError, RemoteProtocolError, TimedOutError
from kvtierd.pool.connect import POOL_ERRORS, RedisLike, describe_failure
from kvtierd.pool.consensus import (
    FORMAT_VERSION,
    Adopt,
    CastVote,
    Decision,
    GroupKeys,
    GroupState,
    GroupStatus,
    Proposal,
    RankState,
    RoundId,
    Vote,
    backoff_delay,
    decode_decision,
    decode_proposal,
    decode_vote,
    describe_decision,
    encode,
    tally,
)

__all__ = ["GroupMembership", "GroupState", "GroupStatus", "RedisLike"]

log = logging.getLogger("kvtierd.pool")

_T = TypeVar("_T")

#: Proposal, decision and counters outlive any round; a day after a group's last round they go.
_RECORD_TTL_S = 86_400


class _PoolLost(Exception):
    """Internal: the pool failed under this rank; ``reason`` is log-safe."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _as_bytes(value: bytes | str) -> bytes:
    # A client made with decode_responses=True hands out str; the records are bytes.
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value


class GroupMembership:
    """This rank's part in its TP group's decision to attach to the pool.

    ``connect`` returns a new connected (authenticated) client or raises; ``probe(client)`` is the
    write/read check a rank passes before voting yes, and raises on failure. ``digest`` is the
    digest of the pool configuration that must match across ranks. ``on_change`` is called (in
    :meth:`run`'s task) with every new :attr:`status`. ``key_prefix`` is the pool's key prefix.
    Raises :class:`ConfigError` for an impossible configuration.
    """

    def __init__(
        self,
        *,
        group_id: str,
        rank: int,
        world_size: int,
        address: str,
        digest: str,
        connect: Callable[[], Awaitable[RedisLike]],
        probe: Callable[[RedisLike], Awaitable[None]],
        vote_timeout_s: float = 5.0,
        heartbeat_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.1, 5.0),
        on_change: Callable[[GroupStatus], None] | None = None,
        key_prefix: str = "kvt",
    ) -> None:
        if vote_timeout_s <= 0 or heartbeat_s <= 0:
            raise ConfigError("vote_timeout_s and heartbeat_s must be positive")
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ConfigError(f"backoff_s {backoff_s} must be (min, max) with 0 < min <= max")
        self.group_id = group_id
        self.address = address
        self._keys = GroupKeys(group_id, key_prefix)
        self._state = RankState.initial(
            group_id=group_id,
            rank=rank,
            world_size=world_size,
            digest=digest,
            voter=secrets.token_hex(8),
            now=time.time(),
        )
        self._connect = connect
        self._probe = probe
        self.vote_timeout_s = vote_timeout_s
        self.heartbeat_s = heartbeat_s
        #: The longest any one pool command may take before the pool counts as unreachable.
        self.op_timeout_s = max(2.0 * heartbeat_s, 1.0)
        self._backoff_s = backoff_s
        self._on_change = on_change
        self._client: RedisLike | None = None
        self._changed: anyio.Event | None = None
        self._last_logged = ""
        # leader only: the open round and when to retry after a refusal
        self._round: tuple[Proposal, bytes, float] | None = None
        self._seen_requests: int | None = None
        self._retry_at: float | None = None
        self._refused_in_a_row = 0
        # follower only: the last attaching decision that did not count this process's vote
        self._uncounted_round: RoundId | None = None

    # -- public ----------------------------------------------------------------------------

    @property
    def status(self) -> GroupStatus:
        return self._state.status

    @property
    def client(self) -> RedisLike | None:
        """The live client while connected (the pool tier reuses it); ``None`` otherwise."""
        return self._client

    @property
    def is_leader(self) -> bool:
        return self._state.rank == 0

    async def run(self) -> None:
        """Take part in the group until cancelled. Pool failures are logged and retried, never
        raised; the client is closed on the way out."""
        try:
            await self._take_part()
        finally:
            # Whoever reads the status after run() must not see a group this rank left.
            old = self.status
            self._state.pool_lost("not taking part in the group (stopped)", time.time())
            self._publish(old)

    async def _take_part(self) -> None:
        attempt = 0
        while True:
            client = await self._connect_with_backoff()
            connected_at = anyio.current_time()
            try:
                await self._serve(client)
            except _PoolLost as lost:
                self._lose(lost.reason)
            finally:
                self._client = None
                self._round = None
                with anyio.CancelScope(shield=True):
                    await self._close(client)
            # A connection that lasted resets the back-off; one lost at once (a flapping pool)
            # waits longer each time.
            served_s = anyio.current_time() - connected_at
            attempt = 0 if served_s > self._backoff_s[1] else min(attempt + 1, 32)
            await anyio.sleep(self._delay(attempt))

    async def wait_for(self, state: GroupState, timeout_s: float) -> GroupStatus:
        """The status once it is ``state``; raises :class:`TimedOutError` after ``timeout_s``."""
        try:
            with anyio.fail_after(timeout_s):
                while self.status.state is not state:
                    if self._changed is None:
                        self._changed = anyio.Event()
                    await self._changed.wait()
        except TimeoutError:
            raise TimedOutError(
                f"group {self.group_id} rank {self._state.rank} not {state} within {timeout_s} s "
                f"(it is {self.status.state}: {self.status.reason})"
            ) from None
        return self.status

    # -- connection life -------------------------------------------------------------------

    def _delay(self, attempt: int) -> float:
        return backoff_delay(attempt, *self._backoff_s, random.random())

    async def _connect_with_backoff(self) -> RedisLike:
        attempt = 0
        while True:
            try:
                return await self._connect()
            except Exception as exc:  # the caller's factory: any failure means "try again later"
                self._lose(f"pool unreachable: {describe_failure(exc)}")
            await anyio.sleep(self._delay(attempt))
            attempt = min(attempt + 1, 32)

    async def _close(self, client: RedisLike) -> None:
        try:
            with anyio.move_on_after(self.op_timeout_s):
                await client.aclose()
        except POOL_ERRORS as exc:
            log.debug("group %s: closing the pool client failed: %s", self.group_id, exc)

    async def _pool(self, op: Awaitable[_T]) -> _T:
        """Await one pool command; a failure or no reply in time raises :class:`_PoolLost`."""
        try:
            with anyio.fail_after(self.op_timeout_s):
                return await op
        except TimeoutError:
            raise _PoolLost(
                f"pool unreachable: no reply within {self.op_timeout_s:.1f} s"
            ) from None
        except POOL_ERRORS as exc:
            raise _PoolLost(f"pool unreachable: {describe_failure(exc)}") from None

    async def _run_id(self, client: RedisLike) -> str:
        """The run id of the server holding the group's slot: it changes when that server
        restarts (or, in a cluster, when another node takes the slot over)."""
        if isinstance(client, RedisCluster):
            try:  # synchronous, and raises SlotNotCoveredError while the cluster is down
                node = client.get_node_from_key(self._keys.epoch)
            except POOL_ERRORS as exc:
                raise _PoolLost(f"pool unreachable: {describe_failure(exc)}") from None
            info = await self._pool(client.info("server", target_nodes=node))
        else:
            info = await self._pool(client.info("server"))
        run_id = info.get("run_id")
        if run_id is None and info:  # some redis-py versions key a node's reply by the node
            run_id = next(iter(info.values())).get("run_id")
        return str(run_id)

    async def _serve(self, client: RedisLike) -> None:
        """Heartbeat and tick on ``client`` until the pool is lost (raises :class:`_PoolLost`)."""
        run_id = await self._run_id(client)
        self._client = client
        if self.is_leader:
            self._seen_requests = -1  # always propose right after connecting
            self._retry_at = None
        else:
            await self._request_round(client)
        tick_s = self.heartbeat_s / 4
        next_beat = anyio.current_time() + self.heartbeat_s
        while True:
            if self.is_leader:
                await self._lead(client)
            else:
                await self._follow(client)
            if anyio.current_time() >= next_beat:
                if await self._run_id(client) != run_id:
                    raise _PoolLost("pool restarted (the server's run id changed)")
                next_beat = anyio.current_time() + self.heartbeat_s
            await anyio.sleep(tick_s)

    # -- the leader ------------------------------------------------------------------------

    async def _lead(self, client: RedisLike) -> None:
        if self._round is not None:
            await self._collect(client, *self._round)
            return
        due = self._retry_at is not None and anyio.current_time() >= self._retry_at
        if due or await self._round_requests(client) != self._seen_requests:
            await self._propose(client)

    async def _round_requests(self, client: RedisLike) -> int:
        return int(await self._pool(client.get(self._keys.round_requests)) or 0)

    async def _propose(self, client: RedisLike) -> None:
        epoch = int(await self._pool(client.incr(self._keys.epoch)))
        await self._pool(client.expire(self._keys.epoch, _RECORD_TTL_S))
        proposal = Proposal(
            version=FORMAT_VERSION,
            round=RoundId(epoch, secrets.token_hex(8)),
            world_size=self._state.world_size,
            address=self.address,
            digest=self._state.digest,
            vote_timeout_s=self.vote_timeout_s,
        )
        data = encode(proposal)
        await self._pool(client.set(self._keys.proposal, data, ex=_RECORD_TTL_S))
        # Read after the proposal is out: a rank counted here will see this proposal (or a later
        # one) when it next looks, so its request is served by this round, not by another.
        self._seen_requests = await self._round_requests(client)
        self._round = (proposal, data, anyio.current_time() + self.vote_timeout_s)
        log.debug("group %s: proposed round %s", self.group_id, proposal.round)
        await self._vote(client, proposal)

    async def _collect(
        self, client: RedisLike, proposal: Proposal, data: bytes, deadline: float
    ) -> None:
        if await self._pool(client.get(self._keys.proposal)) != data:
            self._round = None
            self._schedule_retry()
            reason = f"round epoch {proposal.round.epoch} abandoned: its proposal left the pool"
            old = self.status
            self._state.abandon(reason, time.time())
            self._publish(old)
            log.warning("group %s: %s", self.group_id, reason)
            return
        raw_votes = await self._pool(client.hgetall(self._keys.votes(proposal.round)))
        votes = self._decode_votes(raw_votes)
        timed_out = anyio.current_time() >= deadline
        decision = tally(proposal, votes, self._state.world_size, timed_out)
        if decision is None:
            return
        if decision.attached:
            # Every request made before the votes were read came from a process that either
            # has its vote counted here (served) or will see this decision is not its own and
            # ask again (:meth:`_follow`). Without this, a follower that connected just after
            # the proposal was out gets a second, needless round that un-attaches the group.
            self._seen_requests = await self._round_requests(client)
        await self._pool(client.set(self._keys.decision, encode(decision), ex=_RECORD_TTL_S))
        self._round = None
        if decision.attached:
            self._refused_in_a_row, self._retry_at = 0, None
        else:
            self._schedule_retry()
        self._adopt(decision)

    def _schedule_retry(self) -> None:
        """After a refusal, propose again later: a slow rank or a passing probe failure heals."""
        low = max(self._backoff_s[0], self.vote_timeout_s)
        high = max(self._backoff_s[1], low)
        delay = backoff_delay(self._refused_in_a_row, low, high, random.random())
        self._refused_in_a_row = min(self._refused_in_a_row + 1, 32)
        self._retry_at = anyio.current_time() + delay

    def _decode_votes(self, raw: dict[bytes | str, bytes | str]) -> dict[int, Vote]:
        votes: dict[int, Vote] = {}
        for field, value in raw.items():
            try:
                votes[int(field)] = decode_vote(_as_bytes(value))
            except (ValueError, RemoteProtocolError) as exc:  # counts as no vote from that rank
                log.debug("group %s: ignoring vote field %r: %s", self.group_id, field, exc)
        return votes

    # -- every rank ------------------------------------------------------------------------

    async def _follow(self, client: RedisLike) -> None:
        proposal = self._decode(decode_proposal, await self._pool(client.get(self._keys.proposal)))
        decision = self._decode(decode_decision, await self._pool(client.get(self._keys.decision)))
        step = self._state.next_step(proposal, decision)
        if isinstance(step, CastVote):
            await self._vote(client, step.proposal)
        elif isinstance(step, Adopt):
            self._adopt(step.decision)
        else:
            if decision is not None and self._not_counted_in(decision):
                await self._request_round(client)
            old = self.status
            grace_s = 2 * self.heartbeat_s
            if self._state.decision_overdue(
                now=time.time(), clock=anyio.current_time(), grace_s=grace_s
            ):
                self._publish(old)
                log.warning("group %s: %s", self.group_id, self.status.reason)

    def _not_counted_in(self, decision: Decision) -> bool:
        """Whether ``decision`` attached the group without this process's vote (it counted an
        earlier process of this rank, or this one voted too late): true once per decision."""
        if not decision.attached or decision.voters.get(self._state.rank) == self._state.voter:
            return False
        if decision.round == self._uncounted_round:
            return False
        self._uncounted_round = decision.round
        return True

    async def _request_round(self, client: RedisLike) -> None:
        await self._pool(client.incr(self._keys.round_requests))
        await self._pool(client.expire(self._keys.round_requests, _RECORD_TTL_S))

    def _decode(self, decode: Callable[[bytes], _T], raw: bytes | str | None) -> _T | None:
        if raw is None:
            return None
        try:
            return decode(_as_bytes(raw))
        except RemoteProtocolError as exc:  # e.g. a newer leader's format: wait for one we read
            self._log_once(logging.WARNING, f"group {self.group_id}: {exc}")
            return None

    async def _vote(self, client: RedisLike, proposal: Proposal) -> None:
        probe_error = await self._run_probe(client)
        old = self.status
        vote = self._state.vote_on(
            proposal, probe_error, now=time.time(), clock=anyio.current_time()
        )
        self._publish(old)
        key = self._keys.votes(proposal.round)
        await self._pool(client.hset(key, str(vote.rank), encode(vote)))
        await self._pool(client.expire(key, max(60, round(10 * proposal.vote_timeout_s))))
        if not vote.yes:
            log.warning(
                "group %s rank %d votes no in round epoch %d: %s",
                self.group_id,
                vote.rank,
                proposal.round.epoch,
                vote.reason,
            )

    async def _run_probe(self, client: RedisLike) -> str | None:
        """Why the caller's write/read probe failed, or ``None`` when it passed."""
        limit_s = self.vote_timeout_s
        try:
            with anyio.fail_after(limit_s):
                await self._probe(client)
        except TimeoutError:
            return f"pool probe did not finish within {limit_s:.1f} s"
        except Exception as exc:  # the caller's probe: any failure is a reason to vote no
            return describe_failure(exc)
        return None

    def _adopt(self, decision: Decision) -> None:
        old = self.status
        self._state.adopt(decision, time.time())
        self._publish(old)
        text = describe_decision(self.group_id, decision)
        if decision.attached:
            log.info("%s", text)
            self._last_logged = ""
        else:
            # A refused group retries: say it loudly once, then quietly while nothing changes.
            self._log_once(logging.WARNING, text, key=repr(sorted(decision.refusals.items())))

    def _lose(self, reason: str) -> None:
        old = self.status
        self._state.pool_lost(reason, time.time())
        self._publish(old)
        self._log_once(
            logging.WARNING, f"group {self.group_id}: {reason}; serving from the local tiers"
        )

    def _publish(self, old: GroupStatus) -> None:
        """If the status changed: wake :meth:`wait_for` and call ``on_change``."""
        status = self._state.status
        if status == old:
            return
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        if self._on_change is not None:
            self._on_change(status)

    def _log_once(self, level: int, text: str, *, key: str | None = None) -> None:
        """Log at ``level`` unless the same message (or ``key``) was the last one: then debug."""
        key = text if key is None else key
        log.log(level if key != self._last_logged else logging.DEBUG, "%s", text)
        self._last_logged = key
