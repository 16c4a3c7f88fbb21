"""``freeze_startup_heap``: what is alive is frozen; what is made afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from phloem.runtime.scheduler.process import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_moves_live_objects_out_and_later_cycles_are_still_collected() -> None:
    before = Node()
    try:
        frozen = freeze_startup_heap()
        # frozen objects can still be freed by reference counting (other threads of the test
        # process drop theirs at any time), never added to: the count only shrinks after the call
        assert 0 < gc.get_freeze_count() <= frozen
        assert gc.is_tracked(before)
        later = Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None, "a cycle made after the freeze was not collected"
        ref_before = weakref.ref(before)
        del before
        gc.collect()
        assert ref_before() is not None, "a frozen cycle was scanned and freed"
    finally:
        gc.unfreeze()
    gc.collect()
    assert ref_before() is None
