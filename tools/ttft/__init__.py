"""Time to first token: one benchmark with an engine dimension and a case (tier) dimension.

For a prompt of N tokens (a real LooGLE document cut to fit, then its first question), the time
from the prompt's token ids to the first generated token, on the real SmolLM2-135M, per context
length, in each case asked for, beside a reference measured in the same run:

* engine ``hf`` (:mod:`tools.ttft.hf`, kvtierd's Hugging Face adapter ``kvtierd.engines.hf``):
  ``recompute``, ``dram``, ``nvme_cold`` and ``partial``, each beside the limit the hardware
  sets (the forward over the uncached tokens, plus fio reading the same bytes); and ``pool``
  (:mod:`tools.ttft.pool`): restored from the shared pool after the daemon restarted on a wiped
  data directory, against recomputation (needs ``redis-server``);
* engine ``vllm`` (:mod:`tools.ttft.vllm`, vLLM's CPU backend): ``recompute``,
  ``vllm_prefix``, kvtierd's connector (``kvtierd_dram``, ``kvtierd_nvme_cold``, beside fio),
  vLLM's native offloading with its ``fs`` tier (``vllm_fs_warm``, ``vllm_fs``) and with
  kvtierd as that tier (``kvtierd_tier_warm``, ``kvtierd_tier``).

Cases are measured in groups (:mod:`tools.ttft.cases`): the cases that share one daemon, one
engine and one reference, and alternate with each other run for run (A B A B), because the
virtual disk and the shared CPUs drift; naming any case of a group runs the whole group.
Figures are medians.

A run of an engine's default cases at the default lengths (1K, 2K, 4K, 8K) rewrites its section
of ``docs/benchmarks.md`` ("ttft" for ``hf``, "vllm_ttft" for ``vllm``) and its plot
(:mod:`tools.ttft.report`); ``--tokens`` runs the lengths given and records nothing unless
``--docs PATH`` names where to; ``--no-record`` records nothing; ``--from-json`` rewrites the
section from a saved result without running anything. ``tools/bench_pool.py`` runs the ``pool``
case at 8K for its "pool" section.

Run: ``python -m tools.ttft --engine hf|vllm --json [--cases A,B] [--tokens N ...]
[--data FILE] [--repeats N]``. On 2 shared vCPUs ``hf`` at 1K takes well under a minute after
the model loads; ``vllm`` at 1K about 4 (four engine start-ups), 1K-8K about 12-15.
"""

from __future__ import annotations

import os

# Before torch is loaded (it reads this once): OpenMP worker threads sleep instead of spinning
# between parallel regions. On a shared 2-vCPU machine a spinning worker that another process
# has preempted stalls every small operator: a one-token forward ran 3-5x slower, a prefill 2x.
# It applies to every case alike (recomputation included, and the vLLM engines, which inherit
# it); the JSON records it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
