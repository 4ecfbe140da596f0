"""Crash soak: SIGKILL the daemon at random moments during heavy writes, restart, verify; run
long and recorded. The loop, what it checks after every kill and its hostile tenant are
:mod:`kvtierd.testing.crash` (which ``tests/integration/test_crash.py`` runs for 50 cycles)::

    python -m tools.soak_crash --iterations 500 [--seed 1] [--dir DIR] [--hostile] [--record]

prints a JSON summary; the exit status is 1 when a violation was found. ``--hostile`` adds the
hostile tenant and, where NIXL works, the remote attackers (:mod:`kvtierd.testing.remote_attacks`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtierd.testing.crash import run
from tools import benchlib
from tools.benchlib import log

__all__ = ["main", "record"]


def record(result: dict[str, Any], command: str) -> Path:
    """Write this run's row into the soak section of ``docs/benchmarks.md`` (the other mode's
    row, from the stored JSON, stays)."""
    result = {"command": command, "machine": benchlib.machine(), **result}
    stored = benchlib.ASSETS / "soak_crash.json"
    runs = json.loads(stored.read_text())["runs"] if stored.exists() else {}
    runs["hostile" if result["hostile"] else "plain"] = result
    lines = [
        "## Crash soak: kill -9 during writes, with a hostile tenant (`tools/soak_crash.py`)",
        "",
        "Each cycle starts the daemon on the same data directory (asyncio and trio alternately),"
        " verifies what the previous cycle left, runs clients for 0.05-0.6 s and kills the daemon"
        " with SIGKILL. Honest writers PUT, FORGET, EVICT and FSYNC 16 KiB + 123 B blocks while a"
        " reader checks every block it is served. In the hostile run a client of a second tenant"
        " commits forged records (a header for the honest namespace naming an honest key, with a"
        " payload matching its checksum), scribbles forged records over its whole region and over"
        " the slots it has just committed, punches holes in the region, tries ftruncate, and holds"
        " ALLOCs it never commits, while another of its threads reads its blocks; half the cycles"
        " give the daemon little staging memory (256 KiB), so that most blocks of a long COMMIT"
        " are copied out of their slot (and verified) at write-back rather than at COMMIT. After"
        " every"
        " restart: each acknowledged (FSYNC'd) honest block must be present and byte-exact; every"
        " block served, honest or hostile, must be the bytes committed for it (a miss is allowed"
        " for blocks not acknowledged and for the hostile tenant's own). Acknowledged blocks are"
        " counted at every restart they had to survive.",
        "",
        "| run | cycles | acknowledged blocks checked | recovered byte-exact | wrong bytes served |"
        " hostile blocks served and checked | defence failures | violations | elapsed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in sorted(runs.items(), key=lambda item: item[0] == "hostile"):
        lines.append(
            f"| {mode} (seed {r['seed']}) | {r['iterations']} | {r['durable_expected']:,} |"
            f" {r['durable_recovered']:,} | **{r['wrong_bytes_served']}** |"
            f" {r['hostile_served_checked']:,} | {r['defence_failures']} |"
            f" {len(r['violations'])} | {r['elapsed_s'] / 60:.1f} min |"
        )
    if "hostile" in runs:
        h = runs["hostile"]
        actions = ", ".join(f"{k} {v:,}" for k, v in h["hostile_actions"].items())
        outcomes = ", ".join(f"{k} {v:,}" for k, v in h["hostile_outcomes"].items())
        lines += [
            "",
            f"Hostile run: actions {actions}; outcomes {outcomes}. Write-back dropped"
            f" {h['writebacks_dropped']:,} hostile blocks changed after COMMIT (the daemons'"
            " counts as last read before each kill: a lower bound);"
            f" {h['hostile_misses']:,} hostile reads were"
            " refused by the client's checksum (misses). Honest blocks served and checked:"
            f" {h['served_checked']:,}, reads during the runs {h['reads_during_run']:,}.",
            "",
            "Remote and NIXL attackers (`kvtierd/testing/remote_attacks.py`, issue 31): "
            + (
                f"{h['remote']}. The daemon also listens on TCP (TLS, client certificates) with"
                " NIXL reads on; during every write phase a thread connects and closes before the"
                " handshake, cuts a ClientHello short, sends junk, resets, presents a certificate"
                " of another CA, floods idle connections, and asks over TCP to create a namespace"
                " and to write; after every restart a NIXL reader of the hostile tenant widens its"
                " grant and reads the 32 MiB after its region, 64 MiB below it and an unmapped"
                " address (over TCP with `UCX_TLS=tcp` and locally, alternately). A success of"
                " any of these, an honest block in what the reader pulled, the daemon's exit or an"
                " honest client failing while it runs counts as a failure above."
                if h.get("remote", "").startswith("tcp")
                else f"not run ({h.get('remote') or 'recorded before issue 31'})."
            ),
        ]
    for mode, r in sorted(runs.items(), key=lambda item: item[0] == "hostile"):
        lines += ["", f"The {mode} run: `{r['command']}`. {benchlib.machine_line(r['machine'])}"]
    return benchlib.record("soak_crash", "\n".join(lines), {"runs": runs})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--dir", type=Path, help="data directory (default: a temporary one)")
    parser.add_argument("--dram-size", default="32M")
    parser.add_argument("--nvme-size", default="128M")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--hostile", action="store_true", help="add a hostile tenant's client")
    parser.add_argument("--json", action="store_true", help="print the summary on one line")
    parser.add_argument("--record", action="store_true", help="record into docs/benchmarks.md")
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="kvtierd-soak-"))
    try:
        summary = run(
            args.iterations,
            directory=directory,
            seed=args.seed,
            dram_size=args.dram_size,
            nvme_size=args.nvme_size,
            progress=log,
            hostile=args.hostile,
        )
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    result = {"seed": args.seed, **asdict(summary)}
    print(json.dumps(result, indent=None if args.json else 2))
    if args.record:
        command = ["python -m tools.soak_crash", f"--iterations {args.iterations}"]
        command += [f"--seed {args.seed}"] + (["--hostile"] if args.hostile else [])
        if (args.dram_size, args.nvme_size) != ("32M", "128M"):
            command += [f"--dram-size {args.dram_size}", f"--nvme-size {args.nvme_size}"]
        record(result, " ".join(command))
    return 1 if summary.violations else 0


if __name__ == "__main__":
    sys.exit(main())
