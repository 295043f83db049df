"""Where independent jobs of a sensitivity analysis or a sweep run.

- `InProcess` (the default): one after another in this process.
- `ProcessPool(workers)`: local worker processes (``spawn``ed, so they never inherit a half-initialised
  OpenMP runtime), each with ``threads`` torch threads.
- `Ray(address)`: tasks on a Ray cluster - an existing one (``address="ray://host:10001"`` or ``"auto"``)
  or a local instance started on first use. Ray is an optional extra: ``pip install .[ray]``.

Every executor runs the same job function on the same arguments, so results match the in-process ones
(the tests check it). Jobs are module-level functions and their arguments must pickle (models, tasks
and configs do). ``executor=`` arguments accept an instance or one of the names "inprocess",
"process" and "ray".
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Sequence

__all__ = ["Executor", "InProcess", "ProcessPool", "Ray", "get_executor"]


def _run_with_threads(fn: Callable, threads: int | None, args: tuple):
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return fn(*args)


class Executor:
    """Runs ``fn(*args)`` for each args tuple; `imap` yields ``(index, result)`` as jobs finish."""

    workers: int = 1

    def imap(self, fn: Callable, jobs: Sequence[tuple]) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(workers={self.workers})"


class InProcess(Executor):
    def imap(self, fn, jobs):
        for i, args in enumerate(jobs):
            yield i, fn(*args)


def _default_threads(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


class ProcessPool(Executor):
    """``workers`` local processes with ``threads`` torch threads each (default: cores / workers)."""

    def __init__(self, workers: int = 2, threads: int | None = None):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"ProcessPool.workers must be a positive int, got {workers!r}")
        self.workers = workers
        self.threads = threads or _default_threads(workers)

    def imap(self, fn, jobs):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_run_with_threads, fn, self.threads, tuple(args)): i for i, args in enumerate(jobs)}
            try:
                for fut in as_completed(futures):
                    yield futures[fut], fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise


class Ray(Executor):
    """Ray tasks. ``address``: an existing cluster (``"auto"``, ``"ray://..."``) or None to start a local
    instance with ``num_cpus`` CPUs (default: all) on first use. Each task reserves ``threads`` CPUs and
    runs torch with that many threads."""

    def __init__(self, address: str | None = None, threads: int = 1, num_cpus: int | None = None):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"Ray.threads must be a positive int, got {threads!r}")
        self.address = address
        self.threads = threads
        self.num_cpus = num_cpus
        self.started_here = False

    @property
    def workers(self) -> int:  # type: ignore[override]
        ray = self._ray()
        if not ray.is_initialized():
            return max(1, (self.num_cpus or os.cpu_count() or 1) // self.threads)
        return max(1, int(ray.cluster_resources().get("CPU", 1)) // self.threads)

    @staticmethod
    def _ray():
        try:
            import ray
        except ImportError:
            raise ImportError("executor='ray' needs Ray: pip install 'workbench[ray]' (or pip install ray)") from None
        return ray

    def connect(self):
        ray = self._ray()
        if not ray.is_initialized():
            env = {k: v for k, v in os.environ.items() if k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                 "WORKBENCH_DATA", "WORKBENCH_CACHE")}
            kwargs: dict[str, Any] = dict(address=self.address, include_dashboard=False, log_to_driver=False,
                                          runtime_env={"env_vars": env} if env else None)
            if self.address is None:
                kwargs["num_cpus"] = self.num_cpus
            ray.init(**kwargs)
            self.started_here = self.address is None
        return ray

    def shutdown(self) -> None:
        """Stop the local Ray instance if this executor started it."""
        if self.started_here:
            self._ray().shutdown()
            self.started_here = False

    def imap(self, fn, jobs):
        ray = self.connect()
        remote = ray.remote(num_cpus=self.threads)(_run_with_threads)
        refs = {remote.remote(fn, self.threads, tuple(args)): i for i, args in enumerate(jobs)}
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    yield refs[ref], ray.get(ref)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise


def get_executor(executor: Executor | str | None) -> Executor:
    if executor is None or executor == "inprocess":
        return InProcess()
    if isinstance(executor, Executor):
        return executor
    if executor == "process":
        return ProcessPool()
    if executor == "ray":
        return Ray()
    raise ValueError(f"executor must be an Executor or one of 'inprocess', 'process', 'ray'; got {executor!r}")
