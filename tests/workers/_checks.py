"""Worker-side harness: runs every check_* function of the calling module on
this rank, records pass/fail with the error text, and writes rank<N>.json to
$TF_MPI_TEST_OUT. Checks assert numbers; an exception is a failure, except
SkipCheck, which the pytest side reports as a skip with its reason."""
import inspect
import json
import os
import sys
import time
import traceback


class SkipCheck(Exception):
    """Raised by a check that cannot run in this launch; the reason is shown by pytest."""


def set_environ(settings):
    """Sets each variable of `settings` (a dict) in os.environ; a value of None unsets it.
    Workers call it before restarting the engine, which reads its TF_MPI_* settings at init."""
    for name, value in settings.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


def run_checks(module_globals, rank):
    checks = [(n, f) for n, f in module_globals.items() if n.startswith("check_") and inspect.isfunction(f)]
    checks.sort(key=lambda nf: nf[1].__code__.co_firstlineno)  # file order, identical on every rank
    only = os.environ.get("TF_MPI_TEST_ONLY")
    left_out = os.environ.get("TF_MPI_TEST_EXCEPT", "").split(",")
    results = {}
    for name, fn in checks:
        if (only and name not in only.split(",")) or name in left_out:
            continue
        start, start_cpu = time.time(), time.process_time()
        try:
            fn()
            # wall and CPU seconds (all of this rank's threads): where a launch's time goes
            results[name] = {"ok": True, "seconds": round(time.time() - start, 3),
                             "cpu_seconds": round(time.process_time() - start_cpu, 3)}
        except SkipCheck as e:
            results[name] = {"ok": True, "skipped": str(e) or "skipped"}
        except Exception as e:  # record and go on: the other checks still run
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
            print(f"[rank {rank}] {name} FAILED: {e}", file=sys.stderr, flush=True)
    out = os.environ.get("TF_MPI_TEST_OUT")
    if out:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    return results
