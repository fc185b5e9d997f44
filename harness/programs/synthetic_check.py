"""The checker of one synthetic task: runs its hidden tests against the solution.

Runs in the sandbox as ``python3 -I -S .synthetic_check.py`` (stdlib only: it imports
nothing of fleetrl). Plain mode checks ``SOLUTION`` in the current directory and
prints one verdict line, ``synthetic check: x:verdict ...`` (a verdict is pass,
wrong, raised, timeout, died, garbled or skipped; a parenthesised reason may follow),
then ``passed/total``. ``--group DIR`` checks every attempt directory ``DIR/<k>/`` and
prints each one's two lines after a header ``@@fleetrl-attempt <k> exit=0``, then
``@@fleetrl-attempt end``.

Each test runs in a forked child with a deadline; a test that times out or kills the
child fails and a fresh child runs the remaining tests, so code that raises, loops,
exits, prints junk or defines the wrong name only loses points.

``fleetrl.harness.synthetic`` writes one copy per task, with the block of task
constants below replaced by that task's (`fleetrl.harness.program_files`); the
sample values let the file run as it is (a solution of f(x) = x + 3).
"""

import os
import select
import sys
import time

# --- fleetrl: task constants (replaced for each task) ---
SOLUTION = "solution.py"
PROMPT = "# f(0)=3 f(1)=4 f(4)=7 f(9)=12 f(13)=16\ndef f(x):\n"
STOP = "<eos>"
ENTRY = "f"
TESTS = [[2, 5], [3, 6], [5, 8], [7, 10], [10, 13], [14, 17], [17, 20], [20, 23]]
PER_TEST_S = 0.5
STARTUP_S = 5.0
BUDGET_S = 12.0
MEMORY = 268435456
# --- fleetrl: end of task constants ---

SIGKILL = 9  # POSIX; not `import signal`, whose enum set-up doubles the start-up time


def solution_module(path):
    # solution.py cut at the stop marker; a bare body (first non-blank line
    # indented) is put under the prompt.
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as err:
        return None, "cannot read %s: %s" % (SOLUTION, type(err).__name__)
    cut = text.find(STOP)
    if cut >= 0:
        text = text[:cut]
    if text.startswith(PROMPT):
        return text, ""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first[:1] in (" ", "\t"):
        return PROMPT + text, ""
    return text, ""


def serve(module, requests, replies):
    # The forked child: load the solution, then answer one test per request line.
    # Its stdio goes to /dev/null; it never returns into the checker's code.
    try:
        os.setsid()
        try:  # die with the checker: a checker killed from outside must not leave us running
            import ctypes  # already loaded in group mode (protect)
            ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (Linux)
        except Exception:
            pass
        if os.getppid() == 1:
            os._exit(1)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
        except Exception:
            pass
        out = os.fdopen(replies, "w", buffering=1)
        inp = os.fdopen(requests, "r")
        namespace = {"__name__": "__solution__"}
        try:
            exec(compile(module, SOLUTION, "exec"), namespace)
            fn = namespace[ENTRY]
            if not callable(fn):
                raise TypeError(ENTRY + " is not callable")
        except BaseException as err:
            out.write("load-error %s\n" % type(err).__name__)
            return
        out.write("ready\n")
        for line in inp:
            x, want = TESTS[int(line)]
            try:
                got = fn(x)
                # exact type: True for 1 or 1.0 for 1 is a wrong answer
                reply = "pass" if type(got) is type(want) and got == want else "wrong"
            except BaseException:
                reply = "raised"
            out.write(reply + "\n")
    finally:
        os._exit(0)


class Child:
    # A forked process running the solution (fork: no interpreter start-up per
    # child); killed with its whole process group when done or stuck.

    def __init__(self, module):
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.req_w)
            os.close(self.rep_r)
            serve(module, req_r, rep_w)
        os.close(req_r)
        os.close(rep_w)
        self.buf = b""
        self.status = None

    def send(self, index):
        try:
            os.write(self.req_w, b"%d\n" % index)
        except OSError:
            pass  # the child is gone; reply() sees end of file

    def reply(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.rep_r], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.rep_r, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("ascii", "replace")

    def exited(self):
        pid, _ = os.waitpid(self.pid, os.WNOHANG)
        return pid != 0

    def close(self):
        for sig_target in (lambda: os.killpg(self.pid, SIGKILL), lambda: os.kill(self.pid, SIGKILL)):
            try:
                sig_target()
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.req_w)
        os.close(self.rep_r)


def check(module, why):
    # The verdict lines of one solution (module text, or None and why not).
    end = time.monotonic() + BUDGET_S
    verdicts = ["skipped"] * len(TESTS)
    i = 0
    while module is not None and i < len(TESTS) and time.monotonic() < end:
        child = Child(module)
        try:
            hello = child.reply(min(end, time.monotonic() + STARTUP_S))
            if hello != "ready":
                why = "load failed: %s" % (hello or "no answer")
                break
            while i < len(TESTS) and time.monotonic() < end:
                child.send(i)
                got = child.reply(min(end, time.monotonic() + PER_TEST_S))
                i += 1
                if got is None:
                    verdicts[i - 1] = "died" if child.exited() else "timeout"
                    break  # a fresh child runs the remaining tests
                verdicts[i - 1] = got if got in ("pass", "wrong", "raised") else "garbled"
        finally:
            child.close()
    passed = verdicts.count("pass")
    detail = " ".join("%s:%s" % (x, v) for (x, _), v in zip(TESTS, verdicts))
    return "synthetic check: %s%s\n%d/%d\n" % (detail, (" (" + why + ")") if why else "", passed, len(TESTS))


def protect():
    # Group mode: not dumpable, so no solution process can read our memory or
    # open our stdout through /proc (same user), even one that escaped its group.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0 (Linux)
    except Exception:
        pass


def strays(keep):
    # Live processes of our user that are neither us, our ancestors, PID 1 nor in
    # `keep` (those that ran before the first solution).
    uid, me, found = os.getuid(), os.getpid(), []
    mine, pid = set(), me
    while pid > 1 and pid not in mine:  # us and our ancestors
        mine.add(pid)
        try:
            with open("/proc/%d/stat" % pid, "rb") as fh:
                stat = fh.read()
            pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in mine or int(name) in keep or name == "1":
            continue
        try:  # the real uid from status: /proc/PID itself is root's when PID is not dumpable
            with open("/proc/%s/status" % name, "rb") as fh:
                status = fh.read()
            with open("/proc/%s/stat" % name, "rb") as fh:
                stat = fh.read()
            real_uid = int(status.split(b"\nUid:", 1)[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue  # gone
        if real_uid != uid:
            continue
        if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X"):
            found.append(int(name))
    return set(found)


def group(root):
    # Every attempt directory root/<k>/ in index order: all solutions are read first,
    # then each is checked in its own forked children as alone; each section is
    # printed whole after its header. A process of a solution that outlives its
    # check (escaped its process group) ends the run: the attempts not reported are
    # then checked alone by the caller, each in a fresh sandbox.
    protect()
    names = sorted((n for n in os.listdir(root) if n.isdigit()), key=int)
    solutions = [solution_module(os.path.join(root, n, SOLUTION)) for n in names]
    before = strays(set())
    for name, (module, why) in zip(names, solutions):
        text = check(module, why)
        os.write(1, ("@@fleetrl-attempt %s exit=0\n%s" % (name, text)).encode())
        left = strays(before)
        for _ in range(20):  # a killed process group takes a moment to be gone
            if not left:
                break
            time.sleep(0.005)
            left = strays(before)
        if left:
            break
    os.write(1, b"@@fleetrl-attempt end\n")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--group":
        group(sys.argv[2])
    else:
        os.write(1, check(*solution_module(SOLUTION)).encode())


if __name__ == "__main__":
    main()
