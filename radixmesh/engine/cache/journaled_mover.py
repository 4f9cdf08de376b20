"""The leader's host-tier mover under tensor parallelism: engine.cache.host_pool.KVMover with every copy also written
to the step journal the followers replay."""

from __future__ import annotations

from radixmesh.engine.cache.host_pool import KVMover, Pending


class JournaledMover:
    """The leader's mover under tensor parallelism: each copy is also recorded in the step journal, for the
    followers to make the same copy of their KV shards before the next forward (ModelRunner.follow). A follower's
    copy to the host is done only once it replayed the journal: `sync` waits for that (ModelRunner.sync_followers)
    before the leader reads or frees its followers' host pages (the L3 store's traffic).

    Over a replicated host tier (host_pool.HostKVPool's `replicated`: one copy every rank maps) a follower's device
    pages equal the leader's, so only the leader copies them to the host (no journal entry); its loads read the
    leader's copy, so `sync` also waits for the loads journaled since the last one before a host page is freed."""

    def __init__(self, mover: KVMover, journal: list, sync_followers=None):
        self.mover, self.journal = mover, journal
        self._sync_followers = sync_followers
        self._unsynced = False  # follower copies touching the host pages, journaled since the last sync
        self.replicated = mover.host.replicated

    def sync(self) -> None:
        if self._unsynced and self._sync_followers is not None:
            self._sync_followers()
        self._unsynced = False

    def to_host(self, dev_pages: list[int], host_pages: list[int]) -> Pending:
        if not self.replicated:
            self.journal.append(("to_host", list(dev_pages), list(host_pages)))
            self._unsynced = True
        return self.mover.to_host(dev_pages, host_pages)

    def to_device(self, host_pages: list[int], dev_pages: list[int]) -> Pending:
        self.journal.append(("to_device", list(host_pages), list(dev_pages)))
        self._unsynced = self._unsynced or self.replicated
        return self.mover.to_device(host_pages, dev_pages)

    def flush(self) -> None:
        self.mover.flush()

    def take_ready(self) -> list | None:
        return self.mover.take_ready()
