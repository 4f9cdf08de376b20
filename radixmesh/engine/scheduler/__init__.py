from radixmesh.engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
