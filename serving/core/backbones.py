"""Backbones shared by several served models (issue 51): bundles whose backbone graph is the same (by
hash: serving/bundle/format.backbone_key) share ONE backbone session and ONE batch lane, each with its
own head.

`BackboneGroup` holds the shared `Runtime` and the `Batcher` whose `compute` runs the backbone once
over every job of a batch, whichever model it is for, then hands each model's jobs with their rows of
the embeddings to that model's engine (`Engine._compute(jobs, shared, h)`): its head step, its passes,
its index. A batch whose jobs are all one model's goes to that engine as it is (the single-model path,
unchanged). `ModelRuntime` is what each model's engine sees as its runtime: the shared sessions, and
its own full.onnx (which holds its head) when its pass strategy reads it.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from serving.core.batcher import Batcher, Job
from serving.core.device import backend

log = logging.getLogger(__name__)


class ModelRuntime:
    """One model's view of a shared Runtime: the backbone sessions (and their small-batch choice) are the
    group's; full.onnx, which holds the head, is this bundle's own."""

    def __init__(self, group: "BackboneGroup", bundle, first: bool):
        self.group = group
        # full.onnx holds a copy of the backbone: only the group's first model (a server of one bundle
        # as before) may open it; a model sharing the backbone has its passes read its head rows
        self.first = first
        self.shared = group.runtime
        self.bundle = bundle
        self._lock = threading.Lock()
        self._full = None

    def __getattr__(self, name: str) -> Any:  # backbone, providers, threads, uses_cuda, embed, small_batch_max…
        return getattr(self.shared, name)

    def choose_small_batches(self, *args, **kwargs) -> int:
        """Chosen once for the group (at its first model's warm-up): the sessions are the same."""
        if self.group.small_chosen:
            return self.shared.small_batch_max
        self.group.small_chosen = True
        return self.shared.choose_small_batches(*args, **kwargs)

    @property
    def full(self):
        if not self.first:
            raise RuntimeError("full.onnx is not opened for a model sharing its backbone (it holds a second copy "
                               "of the backbone); the passes read the head rows")
        with self._lock:
            if self._full is None:
                self._full = self.shared._session(self.bundle.graph_path("full"))
            return self._full

    def drop_full(self) -> None:
        with self._lock:
            self._full = None

    def full_logits(self, x: np.ndarray) -> np.ndarray:
        sess = self.full
        (z,) = sess.run([sess.get_outputs()[0].name], {sess.get_inputs()[0].name: x})
        return z


class BackboneGroup:
    """The models of one backbone graph: one Runtime, one Batcher, the engines that use them."""

    def __init__(self, key: str, runtime, settings, metrics=None):
        self.key = key
        self.runtime = runtime
        self.engines: set = set()
        self.small_chosen = False
        self.views = 0  # models that have joined the group, ever
        self.stopped = False
        lanes = backend.lanes(settings.concurrent_batches, runtime)  # batches computed at once
        self.batcher = Batcher(self.compute, max_batch=settings.max_batch, max_delay_ms=settings.max_delay_ms,
                               queue_size=settings.queue_size, metrics=metrics,
                               inline_max_s=settings.inline_max_ms / 1000,
                               in_flight=(lambda: metrics.in_flight) if metrics is not None and settings.adaptive_delay
                               else None, lanes=lanes)

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        """Finish what is queued, then stop the lane (once)."""
        if not self.stopped:
            self.stopped = True
            await self.batcher.stop()

    def join(self, engine) -> None:
        """A model's engine starts using the lane; every model of the group keeps a reserve of its queue
        (Batcher.reserve), so one flooding model cannot turn the others' requests into 429s."""
        self.engines.add(engine)
        self.batcher.sharers = len(self.engines)

    def leave(self, engine) -> None:
        self.engines.discard(engine)
        self.batcher.sharers = max(1, len(self.engines))

    def view(self, bundle) -> ModelRuntime:
        self.views += 1
        return ModelRuntime(self, bundle, first=self.views == 1)

    def compute(self, jobs: list[Job], shared: bool = False) -> list[Any]:
        """The batch's results, one per job: one backbone call over every job's inputs, then each
        model's own step on its rows (the jobs of one model alone: that engine's compute as it is)."""
        owners: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            owners.setdefault(id(job.owner), []).append(i)
        if len(owners) == 1:
            return jobs[0].owner._compute(jobs, shared)
        xs = [j.x for j in jobs]
        offsets = np.cumsum([0] + [j.n for j in jobs])
        need = any(jobs[idx[0]].owner.needs_embedding([jobs[i] for i in idx]) for idx in owners.values())
        h = self.runtime.embed(np.concatenate(xs), one_thread=shared) if need else None  # [M, d], once
        results: list[Any] = [None] * len(jobs)
        for idx in owners.values():
            mine = [jobs[i] for i in idx]
            rows = None if h is None else np.concatenate([h[offsets[i]:offsets[i + 1]] for i in idx])
            for i, result in zip(idx, mine[0].owner._compute(mine, shared, h=rows)):
                results[i] = result
        return results

