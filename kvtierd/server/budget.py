"""The descriptor budget: how many descriptors each listener may hold, and ``RLIMIT_NOFILE``
checked against their sum.

Theory of operation. Every connection holds a descriptor from ``accept`` to its close, and a
process at ``RLIMIT_NOFILE`` can neither accept nor open anything (the NVMe file, a thread's
pipe, a pool connection): ``EMFILE``. A peer that opens connections and sends nothing costs one
descriptor each and nothing else, so without caps one listener's flood starves every other.
Each listener therefore has a cap of its own, which the accept loop enforces
(:mod:`kvtierd.server.accepting`, :mod:`kvtierd.server.endpoint`):

* the Unix socket: ``daemon.max_connections`` sessions, and :data:`UNIX_REFUSALS` more being
  told ``EBUSY`` (a refusal holds its descriptor up to a second, to read the client's INIT);
* TCP (``remote.listen``): ``remote.max_handshakes`` connections before their session (the TLS
  handshake, the identity, a refusal; ``remote.max_handshakes_per_host`` of them from one
  source host) and ``remote.max_connections`` sessions (``remote.max_connections_per_uid`` of
  them for one client);
* the metrics port: twice ``daemon.metrics_max_connections`` (those still sending their
  request, those being answered a scrape) and
  :data:`~kvtierd.server.endpoint.PROBE_ROOM` (probes being answered).

A connection past its listener's cap is closed at once, so no listener's flood can take
another's descriptors, and the Unix socket (the local engines) always has its own. The daemon's
own descriptors (the arena and region memfds, the data file, io_uring, the pool's connections,
NIXL's) are a reserve; the whole budget must fit ``RLIMIT_NOFILE``. At start the daemon raises
its soft limit to the budget where the hard limit allows, and refuses to start where it does not
(:func:`reserve_descriptors`; ``kvtierd --check`` says the same): caps that the kernel would
not honour would let ``EMFILE`` decide instead, at random.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from kvtierd.config import Config
from kvtierd.errors import ConfigError
from kvtierd.server.endpoint import metrics_descriptors

__all__ = [
    "UNIX_REFUSALS",
    "UNIX_REFUSALS_PER_UID",
    "DescriptorBudget",
    "descriptor_budget",
    "reserve_descriptors",
    "unix_uid_share",
]

#: Unix connections being refused (``EBUSY``) at once; more are closed after a non-blocking
#: write of the same frame, without waiting for their INIT.
UNIX_REFUSALS = 32
#: Of those, what one uid may hold beyond its own sessions (``max_connections_per_uid``), so
#: that a uid refused again and again cannot keep every other uid's connection from a slot.
UNIX_REFUSALS_PER_UID = 4
#: Descriptors of the daemon itself, besides the pool's and its connections: standard streams,
#: the event loop's, the arena and data files, io_uring, worker threads, NIXL's and UCX's
#: (35 with NIXL enabled on this project's test host), with room to spare; and per tenant
#: :data:`TENANT_RESERVE` (its region, its NIXL export).
BASE_RESERVE = 96
TENANT_RESERVE = 8


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    """Descriptors each listener may hold, and the daemon's own reserve."""

    unix: int
    tcp: int
    metrics: int
    reserve: int

    @property
    def total(self) -> int:
        return self.unix + self.tcp + self.metrics + self.reserve

    def describe(self) -> str:
        """``"256+32 Unix, 96 TCP, 8 metrics, 256 the daemon's own: 648"``."""
        parts = [f"{self.unix} Unix"]
        if self.tcp:
            parts.append(f"{self.tcp} TCP")
        if self.metrics:
            parts.append(f"{self.metrics} metrics")
        parts.append(f"{self.reserve} the daemon's own")
        return f"{', '.join(parts)}: {self.total}"


def descriptor_budget(config: Config) -> DescriptorBudget:
    """The budget ``config`` asks for (see the module docstring)."""
    daemon, remote = config.daemon, config.remote
    tcp = remote.max_handshakes + remote.max_connections if remote.listen else 0
    metrics = metrics_descriptors(daemon.metrics_max_connections) if daemon.metrics_port else 0
    pool = config.pool.max_connections if config.pool.url else 0
    reserve = BASE_RESERVE + pool + TENANT_RESERVE * len(config.tenants)
    return DescriptorBudget(daemon.max_connections + UNIX_REFUSALS, tcp, metrics, reserve)


def unix_uid_share(config: Config) -> int:
    """The Unix connections one uid may hold at once, sessions and refusals together: its
    sessions (``daemon.max_connections_per_uid``), one more that takes an idle one's place
    while that one closes, and :data:`UNIX_REFUSALS_PER_UID` being refused."""
    return config.daemon.max_connections_per_uid + 1 + UNIX_REFUSALS_PER_UID


def nofile_limits() -> tuple[int, int]:
    """``RLIMIT_NOFILE`` (soft, hard), ``RLIM_INFINITY`` as a very large number."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = 1 << 62
    return (
        unlimited if soft == resource.RLIM_INFINITY else soft,
        unlimited if hard == resource.RLIM_INFINITY else hard,
    )


def budget_problem(budget: DescriptorBudget, hard: int) -> str | None:
    """Why ``budget`` cannot be held under a hard limit of ``hard``; ``None`` when it can."""
    if budget.total <= hard:
        return None
    return (
        f"the descriptor budget ({budget.describe()}) exceeds RLIMIT_NOFILE {hard}: lower "
        "daemon.max_connections, remote.max_connections, remote.max_handshakes or "
        "daemon.metrics_max_connections, or raise the limit (the unit's LimitNOFILE=)"
    )


def reserve_descriptors(config: Config) -> DescriptorBudget:
    """Raise the soft ``RLIMIT_NOFILE`` to ``config``'s budget where it is lower; raises
    :class:`ConfigError` when the hard limit is lower than the budget."""
    budget = descriptor_budget(config)
    soft, hard = nofile_limits()
    problem = budget_problem(budget, hard)
    if problem is not None:
        raise ConfigError(problem)
    if soft < budget.total:
        _, raw_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (budget.total, raw_hard))
    return budget
