"""Joining the process group: the ranks' start is not bounded by the collectives' timeout.

``torch.distributed.init_process_group(timeout=t)`` uses ``t`` twice: rank 0's store waits
``t`` for every rank to connect, and every collective afterwards fails after ``t``.  A short
``t`` is how a run notices a dead peer quickly, but the ranks' start (a rank re-runs the
script: its imports, the CLI's parsing) is not a collective: on a loaded machine, or when a
scheduler starts the ranks of a job minutes apart, it can take longer than ``t``, and the run
then fails before its first epoch with ``Timed out ... waiting for clients. 1/2 clients
joined.`` (measured on a shared 2-core CI machine with ``t = 20 s``).

:func:`join_process_group` therefore meets at the store with
``max(timeout, rendezvous_timeout)``, sets the store's timeout back to ``timeout`` (what
``init_process_group`` itself does after its rendezvous) and creates the default group on
that store with ``timeout``.  torchrun separates the two in the same way (its rendezvous'
``join_timeout``, 600 s by default).

A rank that fails before it joins is still noticed at once where this package started the
ranks: the launchers' supervision stops the run (:mod:`lightning_fullgraph.launch.launchers`).
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import rendezvous
from torch.distributed.constants import default_pg_timeout

__all__ = ["RENDEZVOUS_TIMEOUT", "destroy_at_exit", "join_process_group", "rendezvous_seconds"]

#: The logger of the Lightning function this module stands in for (``_init_dist_connection``):
#: its lines ("Initializing distributed: ...") are the ones users and their log parsers know,
#: and Lightning gives that logger its handler.
log = logging.getLogger("lightning.fabric.utilities.distributed")

#: How long ranks wait for each other to start (torchrun's default ``join_timeout``).
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
#: torchrun's agent hands its workers its own store; its rendezvous has already happened.
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def rendezvous_seconds(timeout: timedelta | None, rendezvous_timeout: timedelta | None) -> timedelta:
    """How long rank 0's store waits for the others: the longer of the two (either may be
    ``None``: torch's default process-group timeout stands in for it)."""
    return max(timeout or default_pg_timeout, rendezvous_timeout or default_pg_timeout)


def join_process_group(
    environment: Any,
    backend: str,
    timeout: timedelta | None,
    rendezvous_timeout: timedelta | None = RENDEZVOUS_TIMEOUT,
    device_id: torch.device | None = None,
) -> None:
    """Initialises the default process group like Lightning's ``_init_dist_connection``, but
    with the start bounded by ``max(timeout, rendezvous_timeout)`` instead of ``timeout``.

    Args:
        environment: Lightning ``ClusterEnvironment`` (address, port, rank, world size).
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: Every collective's timeout (the process group's), and the store's after the
            rendezvous.
        rendezvous_timeout: How long the ranks may take to reach this call, one after the other.
        device_id: As ``init_process_group``'s (``None`` on CPU).

    Does nothing when a default group exists.  Under torchrun's agent store (its rendezvous
    is done) it calls ``init_process_group`` as Lightning does.  An NCCL group is destroyed at
    exit, as Lightning's connection does (torch warns about one left alive).
    """
    if dist.is_initialized():
        return
    rank, world_size = environment.global_rank(), environment.world_size()
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    kwargs: dict[str, Any] = {"device_id": device_id}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if os.environ.get(_AGENT_STORE_ENV) == str(True):
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    else:
        wait = rendezvous_seconds(timeout, rendezvous_timeout)
        store, rank, world_size = next(rendezvous("env://", rank, world_size, timeout=wait))
        store.set_timeout(timeout or default_pg_timeout)
        # the prefix init_process_group gives the store of its own rendezvous (a multi-tenant
        # store may serve other groups on the same port)
        store = dist.PrefixStore("default_pg", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    if backend == "nccl":
        atexit.register(destroy_at_exit)
    if rank == 0:
        log.info(
            f"{'-' * 100}\ndistributed_backend={backend}\n"
            f"All distributed processes registered. Starting with {world_size} processes\n{'-' * 100}\n"
        )


def destroy_at_exit() -> None:
    """Destroys the default group if it still exists (registered for NCCL at exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()
