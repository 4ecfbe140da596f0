"""The TTFT benchmark's two dimensions, engines and cases, and how its runs are taken.

An engine measures its cases in groups: the cases one daemon and one engine instance measure
together, alternating run for run (A B A B) and sharing one reference. Naming any case of a
group runs the whole group, so a group's figures always come from one alternation; an engine's
reference group runs always, because every other case is compared with it. No I/O here: the
engines (:mod:`tools.ttft.hf`, :mod:`tools.ttft.vllm`) carry the runs out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tools.benchlib import median

__all__ = ["ENGINES", "TV_GOAL", "Engine", "Timings", "UnknownCaseError", "alternate"]


class UnknownCaseError(ValueError):
    """A case name the engine does not measure."""


@dataclass(frozen=True)
class Engine:
    """One engine: the section its default cases record, and its cases by group."""

    name: str
    section: str
    groups: Mapping[str, tuple[str, ...]]
    default_cases: tuple[str, ...]
    #: the group that runs whatever is asked for (its cases are every other's reference)
    reference_group: str | None = None

    @property
    def cases(self) -> tuple[str, ...]:
        return tuple(case for cases in self.groups.values() for case in cases)

    def select(self, names: Iterable[str]) -> tuple[str, ...]:
        """``names`` in the engine's order, each once.

        Raises:
            UnknownCaseError: a name is not one of the engine's cases.
        """
        wanted = set(names)
        unknown = sorted(wanted - set(self.cases))
        if unknown:
            raise UnknownCaseError(
                f"engine {self.name} has no case {', '.join(unknown)} "
                f"(its cases: {', '.join(self.cases)})"
            )
        return tuple(case for case in self.cases if case in wanted)

    def groups_for(self, cases: Iterable[str]) -> tuple[str, ...]:
        """The groups that measure ``cases``, the reference group first."""
        wanted = set(cases)
        return tuple(
            group
            for group, members in self.groups.items()
            if group == self.reference_group or wanted & set(members)
        )

    def records(self, cases: Iterable[str]) -> bool:
        """Whether ``cases`` include every case its section shows."""
        return set(self.default_cases) <= set(cases)


#: The largest top-20 total variation a restore on default settings may show against the
#: engine's own prefix hit (the seed's bar: what a user compares with and without kvtierd).
TV_GOAL = 8e-4
HF_CASES = ("recompute", "dram", "nvme_cold", "partial")
#: the pool case and its context, all measured on the pool's daemon
POOL_CASES = ("recompute", "pool", "nvme_cold", "dram")
VLLM_GROUPS = {
    "vllm": ("recompute", "vllm_prefix"),
    "kvtierd": ("kvtierd_dram", "kvtierd_nvme_cold"),
    #: kvtierd's connector with ``whole_prompt: true``: what the default's fidelity costs
    "kvtierd_whole": ("kvtierd_whole_dram", "kvtierd_whole_nvme_cold"),
    "vllm_fs": ("vllm_fs_warm", "vllm_fs"),
    "kvtierd_tier": ("kvtierd_tier_warm", "kvtierd_tier"),
}
ENGINES = {
    "hf": Engine(
        name="hf",
        section="ttft",
        groups={"daemon": HF_CASES, "pool": ("pool",)},
        default_cases=HF_CASES,
    ),
    "vllm": Engine(
        name="vllm",
        section="vllm_ttft",
        groups=VLLM_GROUPS,
        default_cases=tuple(c for cases in VLLM_GROUPS.values() for c in cases),
        reference_group="vllm",
    ),
}


@dataclass
class Timings:
    """Seconds of every run, by name (a case or a reference), in the order taken."""

    runs: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.runs.setdefault(name, []).append(seconds)

    def medians(self) -> dict[str, float]:
        return {name: median(values) for name, values in self.runs.items()}

    def __contains__(self, name: object) -> bool:
        return name in self.runs

    def __getitem__(self, name: str) -> list[float]:
        return self.runs[name]


def alternate(timings: Timings, repeats: int, steps: Mapping[str, Callable[[], float]]) -> None:
    """Take every step of ``steps`` in turn, ``repeats`` times over (A B A B ...), adding the
    seconds each returns under its name: a measured case and its reference see the same drift
    of the shared CPUs and the virtual disk, so their ratio holds even when neither does."""
    for _ in range(repeats):
        for name, step in steps.items():
            timings.add(name, step())
