"""The engine's hazards, each provoked on purpose. numpy and the
pybind module only (no TensorFlow: each launch starts in about a second).
The scenario is argv[1]; tests/test_hardening.py launches each one.

  engine      np=3: callers' threads execute only small batches inline; completion
              callbacks never run under an engine lock; shutdown sends nothing to
              a departed rank and reports, then cancels, what could not be delivered;
              reducescatter in chunks; an allgather beyond MPI's int counts
              fails on every rank and the engine goes on
  big         np=1, TF_MPI_CHUNK_BYTES=64 MiB: a reducescatter of more than 2^31
              elements per rank works (calloc'd zeros in, 2 GiB out)
  corrupt     np=3: rank 1 sends rank 0 a garbled announcement; rank 0 stops
              coordinating cleanly, every rank's op fails, shutdown() + init() recover.
              Then, in the same launch, the peer liveness check with
              TF_MPI_PEER_TIMEOUT_SECONDS=2 (from a re-init on): a rank whose Python
              sleeps 3x the timeout before submitting is not declared unreachable; a
              SIGSTOPped worker, then a SIGSTOPped rank 0, is, while the others wait in
              negotiation: their collectives fail naming it within the timeout + 3 s
              (a worker's shutdown() while rank 0 is stopped returns as soon); resumed
              (SIGCONT), the stopped rank's own fail too (nobody sends to it any more),
              and shutdown() + init() recover
  stale       np=2: a message sent to a stopped engine is not taken for traffic of the
              engine the next init() starts
  serialized  np=2: MPI initialised by mpi4py at MPI_THREAD_SERIALIZED is refused
  relay       np=4: rank 3's announcement to its parent in the negotiation tree (rank 2)
              is garbled; rank 2 can no longer tell rank 0 what its subtree announced and
              aborts the job (no results: tests/test_hardening.py checks the exit and the log)
  settings    np=3: a TF_MPI_* variable unreadable on rank 1 only fails init() on every
              rank with a message naming it (not a hang); init() then works once fixed;
              ranks waiting in init() for a late one use next to no CPU
"""
import os
import signal
import sys
import threading
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checks import run_checks, set_environ  # noqa: E402

# The pybind module alone (tf_mpi/__init__.py imports TensorFlow).
_pkg = types.ModuleType("tf_mpi")
_pkg.__path__ = [os.path.join(os.path.dirname(os.path.dirname(HERE)), "tf_mpi")]
sys.modules.setdefault("tf_mpi", _pkg)

SCENARIO = sys.argv[1]
WORLD_RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
AVERAGE, SUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4
INT_MAX = 2**31 - 1

if SCENARIO == "serialized":
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI  # noqa: E402
    from tf_mpi import _core  # noqa: E402
else:
    if SCENARIO == "corrupt" and WORLD_RANK == 1:
        # Read when the engine starts: rank 1's 3rd announcement message loses its last byte.
        os.environ["TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT"] = "3"
    if SCENARIO == "relay" and WORLD_RANK == 3:
        os.environ["TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT"] = "3"
    if SCENARIO == "settings" and WORLD_RANK == 1:
        os.environ["TF_MPI_AUTOTUNE"] = "sometimes"
    from tf_mpi import _core  # noqa: E402
    INIT_ERROR = None
    if SCENARIO == "settings":
        try:
            _core.init()
        except (RuntimeError, ValueError) as e:
            INIT_ERROR = str(e)
        os.environ.pop("TF_MPI_AUTOTUNE", None)
    _core.init()
    from mpi4py import MPI  # noqa: E402  (adopts the MPI tf_mpi initialised, at MPI_THREAD_MULTIPLE)

WORLD = MPI.COMM_WORLD


def sum_of_ranks(name):
    y = _core.allreduce(np.array([float(_core.rank())], np.float32), SUM, name)
    assert y[0] == sum(range(_core.size())), (name, y)


def expect_error(fn, *words, within=10.0):
    """Runs fn, which must raise an error whose text contains `words`, within `within` s; returns the text."""
    start = time.time()
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        text = str(e)
        assert all(w in text for w in words), (words, text)
        assert time.time() - start < within, (time.time() - start, text)
        return text
    raise AssertionError(f"no error (expected one mentioning {words})")


if SCENARIO == "engine":
    INLINE_BYTES = 64 << 10  # TF_MPI_INLINE_BYTES's default

    def check_inline_callers_execute_only_batches_that_fit_the_inline_size():
        # Two threads submit 1 KiB allreduces (which they drive themselves),
        # one thread 1 MiB ones: a small request's caller regularly receives a
        # batch holding a 1 MiB allreduce. It must leave it to the engine thread.
        n = _core.size()

        def loop(tag, count, elems, rnd, stagger=0.0):
            for i in range(count):
                if stagger and _core.rank() != 0:
                    time.sleep(stagger)
                y = _core.allreduce(np.full(elems, _core.rank() + 1, np.float32), SUM, f"{tag}.{rnd}.{i}")
                assert y.shape == (elems,) and np.all(y == n * (n + 1) / 2), (tag, i)

        # A caller keeps its batch only while the answer comes within TF_MPI_INLINE_WAIT_US (100 us
        # by default), then hands it to the engine thread; on a loaded machine the answer rarely
        # comes that fast and no batch would run inline. A 200 ms wait (this check's engine only)
        # makes callers run theirs whatever the load.
        set_environ({"TF_MPI_INLINE_WAIT_US": 200_000})
        _core.shutdown()
        _core.init()
        try:
            # Alone, a caller drives its own small batches (nothing else of its rank is in flight),
            # unless the engine thread holds the turn at that moment: up to 10 rounds of 20, every
            # rank going on until all have driven one (the ranks agree after each round, so all
            # make the same calls). The other ranks call 5 ms after rank 0, so that rank 0's
            # engine thread, the coordinator's, is not busy with their announcements when its
            # caller asks for the turn (under load it otherwise held it for all 200 calls).
            for solo in range(10):
                loop("solo", 20, 256, solo, stagger=0.005)
                mine = np.array([1.0 if _core.stats()["inline_batches"] > 0 else 0.0], np.float32)
                if _core.allreduce(mine, SUM, f"solo.agree.{solo}")[0] == n:
                    break
            assert _core.stats()["inline_batches"] > 0, _core.stats()
            for rnd in range(3):
                threads = [threading.Thread(target=loop, args=("small.a", 150, 256, rnd)),
                           threading.Thread(target=loop, args=("small.b", 150, 256, rnd)),
                           threading.Thread(target=loop, args=("big", 15, 1 << 18, rnd))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                    assert not t.is_alive(), "a submitting thread hangs"
        finally:
            set_environ({"TF_MPI_INLINE_WAIT_US": None})
            _core.shutdown()
            _core.init()
        s = _core.stats()
        # A caller hands over as soon as another request of its rank is in
        # flight (engine.cc Drive), so it rarely even meets a large batch
        # (deferred_batches, when it does); either way none may run on it.
        assert 0 < s["inline_max_batch_bytes"] <= INLINE_BYTES, s

    def check_error_paths_complete_their_callers():
        # Completions from every path that fails a request: a duplicate name in
        # flight (refused locally), a mismatch (rank 0's error decision).
        r, n = _core.rank(), _core.size()
        done = {}

        def first():
            done["first"] = _core.allreduce(np.ones(4, np.float32), SUM, "dup.name")

        t = threading.Thread(target=first)
        if r == 0:
            t.start()
            time.sleep(0.5)  # "dup.name" is in flight on rank 0 (the others have not submitted it)
            expect_error(lambda: _core.allreduce(np.ones(4, np.float32), SUM, "dup.name"), "already in flight")
        WORLD.Barrier()
        if r != 0:
            t.start()
        t.join(timeout=30)
        assert not t.is_alive() and np.all(done["first"] == n), done
        shape = (3,) if r == 1 else (4,)
        expect_error(lambda: _core.allreduce(np.ones(shape, np.float32), SUM, "mismatch"),
                     "mismatched allreduce 'mismatch'", "shape")
        sum_of_ranks("after.errors")

    def check_shutdown_sends_nothing_to_a_departed_rank_and_cancels_what_is_left():
        r = _core.rank()
        WORLD.Barrier()
        if r == 1:
            _core.shutdown()
        WORLD.Barrier()
        if r != 1:
            # A decision larger than any eager limit (its name is 300 kB):
            # rank 0 must not send it to rank 1, which stopped receiving.
            expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "long." + "x" * 300_000),
                         "rank 1 called shutdown()")
            # Each announcement of it made rank 0 send an error decision; one
            # more collective makes rank 2 receive every one of them.
            expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "sync"), "rank 1 called shutdown()")
        WORLD.Barrier()
        if r == 0:
            # By now rank 2's engine thread has stopped spinning after its last
            # collective and sleeps until a submission: it will not see the
            # "rank 0 left" message before it announces its next collective.
            time.sleep(0.3)
            _core.shutdown()
            s = _core.stats()
            assert s["undelivered_messages"] == 0 and s["undelivered_bytes"] == 0, s
        WORLD.Barrier()
        if r == 2:
            # Rank 0's engine is gone, rank 2's does not know yet: it announces
            # (1 MB, never received), then learns and fails the op. Its
            # shutdown must cancel the announcement, not free it under MPI.
            expect_error(lambda: _core.allreduce(np.ones(1, np.float32), SUM, "gone." + "y" * 1_000_000),
                         "rank 0 called shutdown()")
            _core.shutdown()
            s = _core.stats()
            assert s["undelivered_messages"] == 1 and s["undelivered_bytes"] > 1_000_000, s
        WORLD.Barrier()
        _core.init()
        sum_of_ranks("after.reinit")

    def check_reducescatter_in_chunks_across_ranks():
        # 4 MB of float32 in 1 MiB MPI calls: each rank's block (uneven: 1001
        # rows over 3 ranks) is reduced onto its rank in two calls.
        r, n = _core.rank(), _core.size()
        rows, cols = 1001, 1000
        x = (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) % 1000) * (r + 1)
        want_all = (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) % 1000) * (n * (n + 1) / 2)
        counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
        start = sum(counts[:r])
        out = _core.reducescatter(x, SUM, "rs.chunks")
        assert out.shape == (counts[r], cols) and np.array_equal(out, want_all[start:start + counts[r]]), r
        avg = _core.reducescatter(x, AVERAGE, "rs.chunks.avg")
        assert np.allclose(avg, want_all[start:start + counts[r]] / n), r

    def check_allgather_beyond_int_counts_fails_on_every_rank_and_the_engine_goes_on():
        # A row longer than 2^31-1 bytes, then more than 2^31-1 rows: both fail
        # on every rank before any MPI call (calloc'd zeros: no memory used).
        expect_error(lambda: _core.allgather(np.zeros((1, INT_MAX + 1), np.int8), "ag.long.row"),
                     "allgather 'ag.long.row'", "2^31-1 bytes")
        expect_error(lambda: _core.allgather(np.zeros(INT_MAX // _core.size() + 1, np.int8), "ag.many.rows"),
                     "allgather 'ag.many.rows'", "2^31-1 rows")
        y = _core.allgather(np.full((2, 3), _core.rank(), np.int32), "ag.after")
        assert y.shape == (2 * _core.size(), 3) and np.all(y[::2] == np.arange(_core.size())[:, None])

    def check_completion_callbacks_never_ran_under_an_engine_lock():
        # Last: counts every completion of the checks above (inline, deferred,
        # failed, shut down). The engine counts each callback that found an
        # engine lock held on its thread.
        s = _core.stats()
        assert s["requests"] > 300 and s["errors"] >= 1, s
        assert s["callbacks_under_lock"] == 0, s

elif SCENARIO == "big":
    def check_reducescatter_above_int_max_elements_per_rank():
        # Each rank's block has 2^31 + 3 int8 elements, so one MPI call could
        # not count it. The input is calloc'd zeros (untouched pages cost no
        # memory) with markers at the edges of blocks, of 64 MiB chunks
        # (TF_MPI_CHUNK_BYTES in this launch) and of the int range.
        r, n = _core.rank(), _core.size()
        block, chunk = 2**31 + 3, 1 << 26
        x = np.zeros(n * block, np.int8)
        marks = sorted({0, 1, chunk - 1, chunk, INT_MAX - 1, INT_MAX, INT_MAX + 1, block - 1})
        x[[b * block + m for b in range(n) for m in marks]] = r + 1  # every rank: sum n(n+1)/2
        x[r * block + 12345 + r] = 10 * (r + 1)                      # rank r alone: 10(r+1)
        out = _core.reducescatter(x, SUM, "rs.big")
        del x
        assert out.shape == (block,), out.shape
        want = {m: n * (n + 1) // 2 for m in marks}
        want[12345 + r] = want.get(12345 + r, 0) + 10 * (r + 1)
        # Every non-zero element, found 8 bytes at a time.
        whole = block // 8 * 8
        words = np.flatnonzero(out[:whole].view(np.uint64))
        got = {int(w) * 8 + j: int(out[w * 8 + j]) for w in words for j in range(8) if out[w * 8 + j]}
        got.update({i: int(out[i]) for i in range(whole, block) if out[i]})
        assert got == want, (sorted(got.items()), sorted(want.items()))

elif SCENARIO == "corrupt":
    def check_a_garbled_announcement_stops_the_engine_cleanly_everywhere():
        r = _core.rank()
        for i in range(2):  # announcement messages 1 and 2 of rank 1 are intact
            sum_of_ranks(f"intact.{i}")
        # Rank 1's 3rd message is one byte short; rank 0 cannot decode it.
        expect_error(lambda: sum_of_ranks("garbled"),
                     "internal error: tf_mpi: truncated negotiation message" if r == 0 else "rank 0 called shutdown()")
        # Later collectives fail at once with the reason, until shutdown() and init().
        expect_error(lambda: sum_of_ranks("refused"),
                     "stopped coordinating" if r == 0 else "rank 0 called shutdown()", within=2)
        os.environ.pop("TF_MPI_FAULT_TRUNCATE_ANNOUNCEMENT", None)
        _core.shutdown()
        _core.init()
        for i in range(3):
            sum_of_ranks(f"after.reinit.{i}")

    # The peer liveness check (cpp/core/transports/liveness.h), in this launch to save one.
    PEER_TIMEOUT_S = 2

    def check_a_rank_whose_python_is_busy_is_not_declared_unreachable():
        _core.shutdown()
        set_environ({"TF_MPI_PEER_TIMEOUT_SECONDS": PEER_TIMEOUT_S})
        _core.init()
        sum_of_ranks("busy.before")
        if _core.rank() == 1:
            time.sleep(3 * PEER_TIMEOUT_S)  # submits nothing; its engine's heartbeats go on
        sum_of_ranks("busy.after")           # ranks 0 and 2 waited for it in negotiation
        sum_of_ranks("busy.next")

    def stop_and_expect_unreachable(victim, tag, resumed_error, leaver=None):
        """`victim` stops itself (SIGSTOP) while the others wait for it in negotiation: each of them
        must get an error naming it; the lowest of them then resumes it (SIGCONT), and the victim's
        next collective fails too (`resumed_error`: nobody sends it heartbeats any more).
        `leaver`, if given, calls shutdown() instead, which waits for rank 0's acknowledgement:
        it must return once rank 0 is declared. shutdown() + init() recover."""
        r = _core.rank()
        pids = WORLD.allgather(os.getpid())
        others = [q for q in range(_core.size()) if q != victim]
        # The leaver writes how long after the collective below it called shutdown(): its departure
        # reaches rank 0 only if it announced it before its own liveness check declared rank 0
        # (from 2 s minus a heartbeat interval after the stop), which a starved process can miss.
        leaver_delay = os.path.join(os.environ["TF_MPI_TEST_OUT"], f"{tag}.leaver_delay")
        sum_of_ranks(f"{tag}.before")
        before = time.time()
        try:
            if r == victim:
                os.kill(os.getpid(), signal.SIGSTOP)
                # A name the others never submit: rank 0 fails it once it has found the others unreachable.
                late = False
                if leaver is not None:
                    with open(leaver_delay) as f:
                        late = float(f.read()) > PEER_TIMEOUT_S / 2
                text = expect_error(lambda: sum_of_ranks(f"{tag}.resumed"), within=PEER_TIMEOUT_S + 5)
                # A late leaver may have left without telling rank 0: then the others are unreachable.
                assert resumed_error in text or (late and "is unreachable (no heartbeat" in text), text
            elif r == leaver:
                start = time.time()
                with open(leaver_delay, "w") as f:
                    f.write(f"{start - before:.3f}")
                _core.shutdown()
                assert time.time() - start < PEER_TIMEOUT_S + 3, time.time() - start
            else:
                # Between the timeout and the timeout + 2 heartbeat intervals (1/3 s each) after the stop.
                expect_error(lambda: sum_of_ranks(f"{tag}.during"), f"rank {victim} is unreachable",
                             "TF_MPI_PEER_TIMEOUT_SECONDS", within=PEER_TIMEOUT_S + 3)
                # Later collectives fail at once, until shutdown() and init().
                expect_error(lambda: sum_of_ranks(f"{tag}.later"), f"rank {victim} is unreachable", within=1)
        finally:
            if r != victim:
                # Neither leaves (shutdown) before the other has seen its errors: a rank 0
                # leaving fails the others' collectives with its own reason.
                other = others[1 - others.index(r)]
                WORLD.sendrecv(r, dest=other, source=other)
                if r == others[0]:
                    os.kill(pids[victim], signal.SIGCONT)
            _core.shutdown()
            _core.init()
        sum_of_ranks(f"{tag}.reinit")

    def check_a_stopped_worker_is_unreachable_for_every_other_rank():
        stop_and_expect_unreachable(2, "stop2", "rank 0 is unreachable")

    def check_a_stopped_rank_0_is_unreachable_for_every_worker():
        # Resumed, rank 0 finds rank 2's departure (it fails the collective at once, naming it).
        stop_and_expect_unreachable(0, "stop0", "rank 2 called shutdown()", leaver=2)

elif SCENARIO == "stale":
    def check_a_message_sent_to_a_stopped_engine_never_reaches_the_next_one():
        r = _core.rank()
        WORLD.Barrier()
        if r == 0:
            time.sleep(0.3)  # rank 1's engine thread is asleep: it will not hear of this before it announces
            _core.shutdown()
        WORLD.Barrier()
        if r == 1:
            # Announced to rank 0's stopped engine (a small, eagerly delivered message), then failed.
            expect_error(lambda: sum_of_ranks("stale.x"), "rank 0 called shutdown()")
            _core.shutdown()
        WORLD.Barrier()
        _core.init()
        # Had the old engine's communicator been freed, Open MPI would give its
        # context to the new one, and with it that message: matched there (as
        # rank 1 announcing "stale.x"), it takes the sequence number of rank 1's
        # first new message, which then never arrives: "fresh" stalls (this
        # launch fails stalls after 10 s).
        sum_of_ranks("fresh")
        if r == 1:
            time.sleep(1.0)  # rank 0 must not run "stale.x" on the strength of the old message
        sum_of_ranks("stale.x")


elif SCENARIO == "relay":
    # Not a check_* function: the job must end inside it (rank 2 calls MPI_Abort).
    for i in range(2):  # announcement messages 1 and 2 of rank 3 are intact
        sum_of_ranks(f"intact.{i}")
    sum_of_ranks("garbled")
    for i in range(20):
        sum_of_ranks(f"after.{i}")
    time.sleep(30)
    print(f"rank {WORLD_RANK}: the job went on after rank 3's garbled message", flush=True)

elif SCENARIO == "settings":
    def check_unreadable_setting_on_one_rank_fails_init_everywhere():
        assert INIT_ERROR is not None, "init() with rank 1's TF_MPI_AUTOTUNE=sometimes did not fail here"
        assert "TF_MPI_AUTOTUNE=sometimes" in INIT_ERROR, INIT_ERROR
        if WORLD_RANK != 1:
            assert "rank 1 cannot start" in INIT_ERROR, INIT_ERROR

    def check_init_works_once_the_setting_is_fixed():
        sum_of_ranks("settings.fixed")

    LATE_S = 3.0

    def check_ranks_waiting_in_init_for_a_late_one_sleep_instead_of_polling():
        # Rank 2 calls init() LATE_S after the others. A blocking MPI collective would have them
        # poll all that time (Open MPI spins in sched_yield on an oversubscribed node, taking CPU
        # from the ranks still starting); init() waits with naps (mpi_context.cc WaitForEveryRank).
        _core.shutdown()
        if WORLD_RANK == 2:
            time.sleep(LATE_S)
        wall, cpu = time.monotonic(), time.process_time()
        _core.init()
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        if WORLD_RANK != 2:
            assert wall > LATE_S - 1.0, f"init() returned after {wall:.2f} s: it did not wait for rank 2"
            assert cpu < 0.1 * LATE_S, f"init() used {cpu:.2f} s of CPU in {wall:.2f} s waiting for rank 2"
        sum_of_ranks("settings.after.late.init")

elif SCENARIO == "serialized":
    def check_mpi_initialised_by_others_below_thread_multiple_is_refused():
        assert MPI.Query_thread() == MPI.THREAD_SERIALIZED, MPI.Query_thread()
        text = expect_error(lambda: _core.init(), "MPI_THREAD_SERIALIZED", "needs MPI_THREAD_MULTIPLE")
        assert not _core.is_initialized(), text
        # mpi4py itself is unaffected.
        assert WORLD.allreduce(1) == WORLD.Get_size()


if __name__ == "__main__":
    run_checks(globals(), WORLD_RANK)
