"""Routing policies by `--policy` name; kv_index is imported only when chosen (it talks to the kvstore)."""

from __future__ import annotations

from typing import Callable

from radixmesh.services.router.policies import CacheAware, Manual, Policy, PowerOfTwo, Random, RoundRobin

def _kv_index(settings, registry) -> Policy:
    from radixmesh.services.router.kv_index import KvIndexPolicy

    return KvIndexPolicy(settings.kvstore_url, settings.kvstore_timeout_s, registry)


def make_policy(name: str, settings, registry=None) -> Policy:
    """The policy `name`; `registry` (WorkerRegistry) lets a policy poll the workers (kv_index polls GetLoads)."""
    makers: dict[str, Callable[[], Policy]] = {
        "round_robin": RoundRobin,
        "random": Random,
        "power_of_two": PowerOfTwo,
        "manual": lambda: Manual(settings.assignment_mode),
        "cache_aware": lambda: CacheAware(settings.cache_threshold, settings.balance_abs_threshold,
                                          settings.balance_rel_threshold, settings.max_tree_tokens),
        "kv_index": lambda: _kv_index(settings, registry),
    }
    return makers[name]()
