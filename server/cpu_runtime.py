"""The OpenMP settings ``espalier serve`` gives torch's CPU kernels, applied before torch loads.

torch's CPU wheels run their parallel kernels on GNU OpenMP, whose threads by default spin-wait
between parallel regions. A decode step of the embedded model is hundreds of short regions
(projections, norms, activations, KV gathers), and each one waits for its slowest thread: on a
machine whose cores are shared (other processes, the server's own grammar and gRPC threads) a
spinning team keeps losing its cores to the other runnable threads and waits out whole
scheduler slices. Passive waiting (threads sleep until the next region) costs a wake-up per
region instead. The decision and its numbers: ``docs/decisions/cpu-openmp-wait.md``.

libgomp reads these variables once, when it is loaded (``import torch``), so they are set in
the environment before that; a value the user set is kept. Spawned children (the engine
process, grammar compile children) inherit them.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"


def runtime_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ``: passive OpenMP waiting, unless the user chose a
    wait policy or a spin count (either says how OpenMP threads wait)."""
    if OMP_WAIT_POLICY in environ or GOMP_SPINCOUNT in environ:
        return {}
    return {OMP_WAIT_POLICY: "PASSIVE"}


def apply_runtime_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Add :func:`runtime_env` to ``environ`` (the process environment, before torch is
    imported); returns what was added."""
    added = runtime_env(environ)
    environ.update(added)
    return added
