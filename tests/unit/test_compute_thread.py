"""engines/compute_thread: once pinned, stage bodies called from any thread run on one thread (the caller waits,
errors and context variables cross); unpinned, they run on the caller's thread. Pinning is for the life of a
process, so each case runs in its own interpreter."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CASE = """
import contextvars, threading
from engines import compute_thread

where = contextvars.ContextVar("where", default="unset")
def body(x):
    return threading.current_thread().name, where.get(), x * 2

def call(out, i):
    where.set(f"caller-{i}")
    out.append(compute_thread.run(body, i))

if PIN:
    compute_thread.pin_to_one_thread()
    compute_thread.pin_to_one_thread()  # idempotent
out = []
threads = [threading.Thread(target=call, args=(out, i), name=f"caller-{i}") for i in range(4)]
for t in threads:
    t.start(); t.join()
callers = {t.name for t in threads}
ran_on = {name for name, _, _ in out}
assert sorted(x for _, _, x in out) == [0, 2, 4, 6]
assert sorted(w for _, w, _ in out) == [f"caller-{i}" for i in range(4)]  # the caller's context came along
if PIN:
    assert len(ran_on) == 1 and not ran_on & callers, (ran_on, callers)
    try:
        compute_thread.run(lambda: 1 / 0)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the body's error did not reach the caller")
else:
    assert ran_on <= callers and len(ran_on) == 4  # no thread of its own: each caller ran its body
print("ok")
"""


def _run(pin: bool) -> subprocess.CompletedProcess:
    code = f"PIN = {pin}\n" + CASE
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_pinned_bodies_run_on_one_thread_that_is_none_of_the_callers():
    out = _run(True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_unpinned_bodies_run_on_the_callers_thread():
    out = _run(False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
