"""The kinds of step the scheduler launches, one object each (docs/design.md §4).

A step kind chooses its batch (``schedule``), hands it to the device (``launch``) and commits its
results (``process``). The batch it builds carries the kind, so the scheduler launches and
processes a batch by asking its kind, never by testing the batch's fields.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

from phloem.runtime.scheduler.batch import ScheduledBatch


class StepKind(Protocol):
    def schedule(self) -> ScheduledBatch | None:
        """This kind's batch for the next step, or None when it has nothing to run now."""

    def launch(self, batch: ScheduledBatch, vocab_mask: Any) -> Future[Any]:
        """Start the batch's computation; the future holds what ``process`` reads."""

    def process(self, batch: ScheduledBatch, fut: Future[Any]) -> None:
        """Commit the batch's results to its requests (its step is the oldest in flight)."""
