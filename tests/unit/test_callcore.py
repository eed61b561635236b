"""The calls' sans-IO core (ringwire._conn.callcore), driven with in-memory envelopes:
no channel, no event loop, no thread -- what a driver would hand it, and what it must
answer, hostile input included."""

from __future__ import annotations

import random
from typing import Any

import pytest
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream

from ringwire import DeadlineExceeded, DecodeError, ProtocolError, RemoteError
from ringwire._conn.callcore import (
    CANCEL_RUNNING,
    START,
    WAKE,
    ClientCore,
    ServerCore,
    is_async,
    no_time,
    outcome,
    server_limits,
    timed_out,
)
from ringwire._wire.envelope import (
    CALL,
    CANCEL,
    DEADLINE_TYPE,
    ERROR,
    REPLY,
    Envelope,
    ErrorInfo,
    remote_error,
)

PID = 4242


class W:
    """A driver's waiter: counts its wake-ups."""

    def __init__(self) -> None:
        self.env: Any = None
        self.error: BaseException | None = None
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def opened(core: ClientCore, n: int) -> list[tuple[int, W]]:
    out = []
    for _ in range(n):
        w = W()
        out.append((core.open(w), w))
    return out


# -- the client core ------------------------------------------------------------------------


def test_ids_count_up_and_replies_reach_their_callers_in_any_order() -> None:
    core = ClientCore(PID)
    calls = opened(core, 5)
    assert [cid for cid, _ in calls] == [1, 2, 3, 4, 5]
    assert core.dispatch([Envelope(REPLY, 4, None, "four"), Envelope(REPLY, 2, None, [2])]) is None
    assert core.dispatch([Envelope(ERROR, 1, None, None, ErrorInfo("ValueError", "bad"))]) is None
    deadline = ErrorInfo(DEADLINE_TYPE, "call 5: refused")
    assert core.dispatch([Envelope(ERROR, 5, None, None, deadline)]) is None
    assert sorted(core.pending) == [3]
    by_id = dict(calls)
    assert [by_id[i].woken for i in (1, 2, 3, 4, 5)] == [1, 1, 0, 1, 1]
    assert outcome(by_id[4]) == "four" and by_id[4].env is None  # handed over, not kept
    assert outcome(by_id[2]) == [2]
    with pytest.raises(RemoteError) as info:
        outcome(by_id[1])
    assert type(info.value) is RemoteError and str(info.value) == "ValueError: bad"
    with pytest.raises(DeadlineExceeded) as dl:
        outcome(by_id[5])
    assert isinstance(dl.value, TimeoutError)  # a wait that timed out is a TimeoutError
    assert "1 pending, open" == core.state()


def test_a_reply_for_a_call_given_up_and_a_duplicate_reply_are_dropped() -> None:
    core = ClientCore(PID)
    (c1, w1), (c2, w2) = opened(core, 2)
    assert core.forget(c1, w1) is True  # unanswered, the connection stands: CANCEL due
    assert core.dispatch([Envelope(REPLY, c1, None, "late")]) is None
    assert w1.env is None and w1.woken == 0
    assert core.dispatch([Envelope(REPLY, c2, None, "x"), Envelope(REPLY, c2, None, "y")]) is None
    assert core.forget(c2, w2) is False  # answered: nothing to cancel
    assert outcome(w2) == "x" and w2.woken == 1
    assert core.failure is None


def test_expire_fails_only_a_call_still_pending() -> None:
    core = ClientCore(PID)
    (c1, w1), (c2, w2) = opened(core, 2)
    assert core.expire(c1, w1, 0.25) is True
    assert isinstance(w1.error, TimeoutError) and "no reply within 0.25 s" in str(w1.error)
    assert w1.woken == 1 and c1 not in core.pending
    core.dispatch([Envelope(REPLY, c2, None, 1)])
    assert core.expire(c2, w2, 1.0) is False and w2.error is None
    assert str(timed_out(2)) == str(TimeoutError("no reply within 2 s"))
    assert "timeout=0" in str(no_time(0))


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (Envelope(REPLY, 77, None, "x"), "a reply for call 77, never made"),
        (Envelope(ERROR, 99, None, None, ErrorInfo("X")), "an error for call 99, never made"),
        (Envelope(CALL, 1, None, "x"), "a call envelope to the client"),
        (Envelope(CANCEL, 1), "a cancel envelope to the client"),
        (Envelope(ERROR, 1, None, None, None), "an error envelope for call 1 without an error"),
    ],
    ids=["unknown-reply", "unknown-error", "call", "cancel", "empty-error"],
)
def test_a_violation_fails_every_call_with_the_protocol_error_as_cause(bad: Any, why: str) -> None:
    core = ClientCore(PID)
    calls = opened(core, 3)
    answered = calls[2][1]
    err = core.dispatch([Envelope(REPLY, 3, None, "ok"), bad, Envelope(REPLY, 1, None, "after")])
    assert isinstance(err, ProtocolError)
    assert str(err) == f"calls: pid {PID} sent {why}"
    assert outcome(answered) == "ok"  # answered before the violation: kept
    errors = [w.error for _, w in calls[:2]]
    for e in errors:
        assert isinstance(e, BrokenResourceError)
        assert e.__cause__ is err and str(e) == f"connection broken: {err}"
    assert errors[0] is not errors[1]  # each caller raises its own exception
    assert all(w.woken == 1 for _, w in calls)
    assert core.pending == {}
    with pytest.raises(BrokenResourceError, match="never made|to the client|without"):
        core.open(W())
    assert core.state().endswith("failed")


@pytest.mark.parametrize(
    ("exc", "cls", "message"),
    [
        (EndOfStream(), BrokenResourceError, f"the server (pid {PID}) closed the connection"),
        (BrokenResourceError("it died"), BrokenResourceError, f"(pid {PID}) is gone: it died"),
        (ClosedResourceError(), ClosedResourceError, "the client's channel was closed"),
        (ProtocolError("bad frame"), BrokenResourceError, "connection broken: bad frame"),
        (RuntimeError("odd"), BrokenResourceError, "failed: RuntimeError: odd"),
    ],
    ids=["eof", "broken", "closed", "protocol", "other"],
)
def test_the_end_of_receiving_fails_every_call_with_what_it_means(
    exc: Exception, cls: type, message: str
) -> None:
    core = ClientCore(PID)
    calls = opened(core, 2)
    core.deferred.append(1)
    assert core.lost(exc) is None
    for _, w in calls:
        assert w.error is not None
        assert type(w.error) is cls and message in str(w.error)
        assert w.error.__cause__ is (None if isinstance(exc, EndOfStream) else exc)
    assert not core.deferred  # no cancel goes out on a failed connection
    core.close()  # the first failure stays
    with pytest.raises(cls) as later:
        core.open(W())
    assert message in str(later.value)


def test_an_undecodable_reply_is_a_protocol_violation() -> None:
    core = ClientCore(PID)
    (_, w), = opened(core, 1)
    err = core.lost(DecodeError("Expected `int`, got `str` - at `$[1]`"))
    assert isinstance(err, ProtocolError)
    assert str(err).startswith(f"calls: pid {PID} sent an undecodable reply envelope: Expected")
    assert isinstance(w.error, BrokenResourceError) and w.error.__cause__ is err


def test_close_fails_pending_and_later_calls_with_closed_resource_error() -> None:
    core = ClientCore(PID)
    (cid, w), = opened(core, 1)
    core.close()
    assert isinstance(w.error, ClosedResourceError) and "the client was closed" in str(w.error)
    assert core.forget(cid, w) is False
    with pytest.raises(ClosedResourceError):
        core.open(W())


def test_hostile_reply_streams_never_raise_and_leave_no_call_hanging() -> None:
    """Random batches, wrong kinds and ids among them: dispatch returns a
    ProtocolError or None, never raises; after a violation nothing is pending and every
    caller has an answer or an error."""
    rng = random.Random(23)
    for _ in range(300):
        core = ClientCore(PID)
        calls = opened(core, rng.randint(1, 6))
        violated = None
        for _ in range(rng.randint(1, 4)):
            batch = []
            for _ in range(rng.randint(1, 5)):
                kind = rng.choice([CALL, REPLY, REPLY, REPLY, ERROR, CANCEL])
                cid = rng.randint(1, len(calls) + 2)
                err = ErrorInfo("E") if kind == ERROR and rng.random() < 0.8 else None
                batch.append(Envelope(kind, cid, None, cid, err))
            violated = core.dispatch(batch)
            if violated is not None:
                break
        if violated is not None:
            assert isinstance(violated, ProtocolError) and core.pending == {}
            assert all(w.env is not None or w.error is not None for _, w in calls)
        for cid, w in calls:
            if cid in core.pending:
                assert w.env is None and w.error is None and w.woken == 0
            else:
                assert w.woken == 1


# -- the server core ------------------------------------------------------------------------


def call(cid: int, payload: Any = None, time_left: float | None = None) -> Envelope:
    return Envelope(CALL, cid, time_left, payload)


def test_calls_start_workers_up_to_concurrency_then_queue_then_fill() -> None:
    core = ServerCore(concurrency=2, max_queued=1, peer_pid=PID)
    assert core.room() == 3
    a = core.dispatch(call(1, "a"), 0.0)
    b = core.dispatch(call(2, "b"), 0.0)
    assert a is not None and b is not None and a[0] == START and b[0] == START
    wa, wb = a[1], b[1]
    assert (wa.job.id, wb.job.id, wa.job.payload) == (1, 2, "a")
    assert core.dispatch(call(3), 0.0) is None  # queued
    assert core.room() == 0 and core.workers == 2
    # worker a answers call 1 and takes call 3 from the queue
    core.finish(wa.job)
    assert core.next_job(wa) is True and wa.job.id == 3
    core.finish(wa.job)
    assert core.next_job(wa) is False and core.idle == [wa]  # idle: waits to be handed one
    assert core.room() == 2
    woken = core.dispatch(call(4), 1.0)
    assert woken == (WAKE, wa) and wa.job.id == 4 and core.idle == []


def test_cancel_drops_a_queued_call_and_cancels_a_running_handler() -> None:
    core = ServerCore(concurrency=1, max_queued=4, peer_pid=PID)
    act = core.dispatch(call(1), 0.0)
    assert act is not None
    me = act[1]
    core.dispatch(call(2), 0.0)
    core.dispatch(call(3), 0.0)
    assert core.dispatch(Envelope(CANCEL, 2), 0.0) is None  # queued: dropped, no reply
    assert 2 not in core.jobs and core.room() == 3
    assert core.dispatch(Envelope(CANCEL, 99), 0.0) is None  # unknown: ignored
    # handed over, not in the handler yet: only marked
    assert core.dispatch(Envelope(CANCEL, 1), 0.0) is None and me.job.cancelled
    core.finish(me.job)
    assert core.next_job(me) is True and me.job.id == 3  # call 2 skipped
    me.in_handler = True
    assert core.dispatch(Envelope(CANCEL, 3), 0.0) == (CANCEL_RUNNING, me)
    assert me.job.cancelled


def test_server_violations_are_protocol_errors_naming_the_peer() -> None:
    core = ServerCore(concurrency=1, max_queued=1, peer_pid=PID)
    core.dispatch(call(5), 0.0)
    with pytest.raises(ProtocolError, match=f"pid {PID} sent call id 5 again while"):
        core.dispatch(call(5), 0.0)
    for kind, name in ((REPLY, "a reply"), (ERROR, "an error")):
        with pytest.raises(ProtocolError, match=f"pid {PID} sent {name} envelope to the server"):
            core.dispatch(Envelope(kind, 6, None, None, ErrorInfo("E")), 0.0)
    err = core.undecodable(DecodeError("garbage"))
    assert str(err) == f"calls: pid {PID} sent an undecodable call envelope: garbage"
    core.finish(core.jobs[5])
    assert core.dispatch(call(5), 0.0) is None  # an id answered may come again (queued)
    assert 5 in core.jobs


def test_deadlines_refuse_late_calls_and_answer_handlers_past_them() -> None:
    core = ServerCore(concurrency=1, max_queued=1, peer_pid=PID)
    act = core.dispatch(call(1, None, 0.5), 10.0)
    assert act is not None
    job = act[1].job
    assert job.deadline == 10.5
    assert core.refusal(job, 10.4) is None
    refused = core.refusal(job, 10.5)
    assert refused is not None and (refused.kind, refused.id) == (ERROR, 1)
    assert refused.error is not None and "refused" in refused.error.message
    assert "waited 0.500 s" in refused.error.message and "concurrency 1" in refused.error.message
    late = core.deadline_error(job, 11.0, started=True)
    assert late.error is not None and "still running at its deadline" in late.error.message
    exc = remote_error(late.error)
    assert isinstance(exc, DeadlineExceeded) and isinstance(exc, TimeoutError)
    assert core.dispatch(call(2), 0.0) is None and core.queue[0].deadline is None


def test_answers_the_server_makes_itself() -> None:
    core = ServerCore(concurrency=1, max_queued=0, peer_pid=PID)
    act = core.dispatch(call(7), 0.0)
    assert act is not None
    job = act[1].job
    raised = ServerCore.raised(job, KeyError("k"))
    assert raised.error == ErrorInfo("KeyError", "'k'") and raised.id == 7
    bad = ServerCore.unsendable(Envelope(REPLY, 7, None, object()), TypeError("no"))
    assert bad.error is not None and bad.error.type == "TypeError"
    assert "call 7: the reply could not be sent: no" == bad.error.message
    detailed = Envelope(ERROR, 7, None, None, ErrorInfo("M", "oom", {"o": 1}))
    cut = ServerCore.unsendable(detailed, ValueError("x"))
    assert cut.error == ErrorInfo("M", "oom (its details could not be sent: x)")
    assert ServerCore.bare(cut).error == ErrorInfo("M")


def test_stop_cancels_every_admitted_call_and_hands_back_the_idle_workers() -> None:
    core = ServerCore(concurrency=2, max_queued=2, peer_pid=PID)
    a = core.dispatch(call(1), 0.0)
    b = core.dispatch(call(2), 0.0)
    assert a is not None and b is not None
    core.finish(b[1].job)
    assert core.next_job(b[1]) is False
    core.dispatch(call(3), 0.0)  # handed to idle b
    core.dispatch(call(4), 0.0)  # queued
    jobs = list(core.jobs.values())
    assert core.stop() == []  # b was handed call 3: not idle any more
    assert all(j.cancelled for j in jobs) and not core.queue and core.room() == 4


def test_limits_and_handler_kinds() -> None:
    assert server_limits(4, None) == 4 and server_limits(4, 0) == 0
    with pytest.raises(ValueError, match="concurrency must be at least 1, not 0"):
        server_limits(0, None)
    with pytest.raises(ValueError, match="max_queued must be at least 0, not -1"):
        server_limits(1, -1)

    async def coro(x: Any) -> Any:
        return x

    class Callable:
        async def __call__(self, x: Any) -> Any:
            return x

    assert is_async(coro) and is_async(Callable()) and not is_async(len)
