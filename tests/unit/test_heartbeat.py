"""The scheduler's heartbeat: the manager's health from beat ages (``Liveness``, on a scripted
clock), the scheduler-side beat and watchdog (``HeartbeatThread.beat``), and the real manager's
``health``/``get_server_info`` when the scheduler stops answering."""

from __future__ import annotations

import asyncio
import time

from phloem.runtime.config import EngineArgs
from phloem.runtime.ipc import IpcPaths
from phloem.runtime.messages import Codec, ControlReply, GetStatsReq, Heartbeat, ToScheduler
from phloem.runtime.scheduler.heartbeat import WATCHDOG_EXIT_CODE, HeartbeatThread, LoopWatch
from phloem.runtime.tokenizer.liveness import LOOP_STALL_S, SILENCE_STALL_S, Liveness
from phloem.runtime.tokenizer.manager import SERVER_INFO_SILENCE_S, TokenizerManager


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- Liveness: the manager's side ----------------------------------------------------------------
def test_silence_past_the_threshold_is_a_stall_and_a_beat_clears_it():
    clock = Clock()
    live = Liveness(watchdog_s=300, clock=clock)
    clock.now += SILENCE_STALL_S - 0.5
    assert live.stall() == ""
    clock.now += 1.0
    assert live.stall() == f"no scheduler heartbeat for {SILENCE_STALL_S + 0.5:.1f} s"
    assert live.lost() == ""  # stalled, not yet given up on
    live.beat(loop_age=0.1)
    assert live.stall() == "" and live.silence() == 0


def test_a_long_step_with_beats_is_not_a_stall_until_the_loop_threshold():
    clock = Clock()
    live = Liveness(watchdog_s=300, clock=clock)
    # the loop is inside one step for a long time, the thread keeps beating
    for age in range(1, int(LOOP_STALL_S)):
        clock.now += 1.0
        live.beat(loop_age=float(age), doing="process EXTEND")
        assert live.stall() == "", age
    clock.now += 2.0
    live.beat(loop_age=LOOP_STALL_S + 1, doing="process EXTEND")
    assert live.stall() == (
        f"the scheduler loop has not completed an iteration for {LOOP_STALL_S + 1:.1f} s (in 'process EXTEND')"
    )
    live.beat(loop_age=0.0)  # the step returned
    assert live.stall() == ""


def test_loop_age_grows_with_silence_between_beats():
    clock = Clock()
    live = Liveness(watchdog_s=300, silence_s=5, loop_s=10, clock=clock)
    live.beat(loop_age=8.0)
    clock.now += 3.0  # no beat for 3 s (under the silence threshold) after a beat saying 8 s
    assert "11.0 s" in live.stall()


def test_no_beat_for_the_watchdog_timeout_is_lost():
    clock = Clock()
    live = Liveness(watchdog_s=12, clock=clock)
    clock.now += 12.5
    assert live.lost() == "no scheduler heartbeat for 12.5 s (--watchdog-timeout 12)"


def test_a_short_watchdog_lowers_the_stall_thresholds():
    live = Liveness(watchdog_s=3, clock=Clock())
    assert live.silence_s == 3 and live.loop_s == 3
    live = Liveness(watchdog_s=300, clock=Clock())
    assert live.silence_s == SILENCE_STALL_S and live.loop_s == LOOP_STALL_S


# ---- HeartbeatThread: the scheduler's side -------------------------------------------------------
def test_beat_carries_the_loop_age_and_what_the_loop_does():
    clock = Clock()
    watch = LoopWatch(lambda: ("process", "DECODE"), clock=clock)
    sent: list[Heartbeat] = []
    exits: list[int] = []
    hb = HeartbeatThread(watch, sent.append, watchdog_timeout=30, exit=exits.append)
    clock.now += 2.5
    hb.beat()
    assert sent == [Heartbeat(loop_age=2.5, doing="process DECODE")]
    watch.stamp()
    hb.beat()
    assert sent[-1].loop_age == 0.0 and exits == []


def test_watchdog_exits_with_one_line_naming_the_stuck_step(caplog):
    clock = Clock()
    watch = LoopWatch(lambda: ("launch", "EXTEND"), clock=clock)
    sent: list[Heartbeat] = []
    exits: list[int] = []
    hb = HeartbeatThread(watch, sent.append, watchdog_timeout=30, exit=exits.append)
    clock.now += 31.0
    with caplog.at_level("ERROR", logger="phloem.scheduler"):
        hb.beat()
    assert exits == [WATCHDOG_EXIT_CODE] and WATCHDOG_EXIT_CODE != 0
    assert sent == []
    [line] = [r.getMessage() for r in caplog.records]
    assert "'launch EXTEND'" in line and "31.0 s" in line and "--watchdog-timeout 30" in line


def test_a_failed_send_is_dropped_and_the_thread_keeps_beating():
    def refuse(msg: Heartbeat) -> None:
        raise RuntimeError("queue full")

    hb = HeartbeatThread(LoopWatch(), refuse, watchdog_timeout=30, exit=lambda code: None)
    hb.beat()  # no exception


def test_the_thread_beats_on_its_interval():
    sent: list[Heartbeat] = []
    hb = HeartbeatThread(LoopWatch(), sent.append, watchdog_timeout=30, interval=0.01)
    hb.start()
    deadline = time.monotonic() + 5
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    hb.stop()
    hb.join(timeout=1)
    assert len(sent) >= 3 and not hb.is_alive()


# ---- the real TokenizerManager -------------------------------------------------------------------
class _Scheduler:
    """Stands in for the scheduler's socket: answers ``GetStatsReq`` through the manager's
    dispatch on the next loop turn, or never (``answer=False``)."""

    def __init__(self, tm: TokenizerManager, answer: bool) -> None:
        self.tm = tm
        self.answer = answer
        self.codec = Codec(ToScheduler)

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        for frame in frames:
            msg = self.codec.decode(frame)
            if self.answer and isinstance(msg, GetStatsReq):
                reply = ControlReply(req_id=msg.req_id, ok=True, data={"num_running_reqs": 0.0})
                asyncio.get_running_loop().call_soon(self.tm._dispatch, reply)


def _manager(clock: Clock, *, answer: bool) -> TokenizerManager:
    tm = TokenizerManager(
        EngineArgs(watchdog_timeout=60), tokenizer=None, ipc=IpcPaths.fresh(),
        model_info={"context_length": 4096, "vocab_size": 1000},
    )  # fmt: skip
    tm.liveness = Liveness(watchdog_s=60, clock=clock)
    tm._status = "serving"
    tm.codec_sched = Codec(ToScheduler)
    tm.to_sched = _Scheduler(tm, answer)  # type: ignore[assignment]
    return tm


def test_manager_health_follows_heartbeats_and_says_why():
    clock = Clock()
    tm = _manager(clock, answer=True)
    assert tm.health() == "serving" and tm.health_message() == ""
    clock.now += 7.0
    assert tm.health() == "stalled"
    assert tm.health_message() == "no scheduler heartbeat for 7.0 s"
    assert tm.heartbeat_age() == 7.0
    tm._dispatch(Heartbeat(loop_age=0.2, doing="receive"))
    assert tm.health() == "serving"
    clock.now += 61.0
    assert tm.heartbeat_lost() == "no scheduler heartbeat for 61.0 s (--watchdog-timeout 60)"
    tm.start_shutdown()
    assert tm.health() == "shutting_down" and tm.heartbeat_lost() == ""


def test_server_info_has_live_stats_when_the_scheduler_answers():
    tm = _manager(Clock(), answer=True)
    info = asyncio.run(tm.get_server_info())
    assert info["status"] == "serving" and info["live"] == {"num_running_reqs": 0.0}
    assert "live_unavailable" not in info


def test_server_info_answers_at_once_while_stalled():
    clock = Clock()
    tm = _manager(clock, answer=False)
    clock.now += 6.0
    start = time.monotonic()
    info = asyncio.run(tm.get_server_info())
    assert time.monotonic() - start < 0.5
    assert info["status"] == "stalled" and info["live"] is None
    assert info["live_unavailable"] == "the server is stalled: no scheduler heartbeat for 6.0 s"
    assert info["watchdog_timeout"] == 60  # the static part is all there


def test_server_info_gives_up_waiting_once_the_heartbeat_goes_quiet():
    # not yet stalled for /health, but the scheduler neither answers nor beats
    clock = Clock()
    tm = _manager(clock, answer=False)
    silent_for = SERVER_INFO_SILENCE_S + 0.5
    clock.now += silent_for
    start = time.monotonic()
    info = asyncio.run(tm.get_server_info())
    assert time.monotonic() - start < 1.0
    assert info["status"] == "serving" and info["live"] is None
    assert info["live_unavailable"] == f"the scheduler did not answer: no heartbeat for {silent_for:.1f} s"


def test_the_scheduler_names_the_step_it_is_in_for_the_watchdog():
    from tests.unit.test_scheduler_loop import FakeRunner, Harness

    seen: list[str] = []

    class Recording(FakeRunner):
        def forward(self, fi):
            seen.append(watch.describe())  # what a beat during this forward pass would report
            return super().forward(fi)

    h = Harness(pool=4096, overlap=False, runner=Recording(4097))
    watch = LoopWatch(lambda: h.s.doing)
    h.add("r", list(range(100, 110)), max_new=3)
    h.run()
    assert seen[0] == "launch EXTEND" and seen[1:] == ["launch DECODE"] * (len(seen) - 1) and len(seen) > 1
