"""Sandbox.exec_many on the real Docker engine: a batch gives, program by program, the
result one exec per program gives in a freshly reset sandbox (pass, fail, timeout,
crash, OOM, huge output, output limit, stdin/env/workdir/files, leftovers of the program
before, a program that kills its parent, one that kills every process); the runner's
report cannot be forged by a program; a final batch leaves the sandbox clean."""

from __future__ import annotations

import pytest
import trio

from fleetrl.sandboxes import ExecSpec, Limits, open_sandbox, open_sandbox_pool

pytestmark = pytest.mark.docker

LIM = Limits(stdout_cap=1000, stderr_cap=300, output_limit_bytes=1 << 20, memory_bytes=128 << 20)
FIELDS = ("exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "stdout_bytes", "stderr_bytes",
          "timed_out", "output_limit_exceeded", "oom_killed")  # fmt: skip
# Counts of what may not carry over: files in the writable dirs, SysV IPC, other processes.
LOOK = (
    "import os\n"
    "print(sorted(os.listdir('/work')), sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))\n"
    "print(len(open('/proc/sysvipc/shm').read().splitlines()) - 1)\n"
    "me = {1, os.getpid(), os.getppid()}\n"
    "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in me))\n"
)
LEAVE = (
    "import ctypes, os, subprocess\n"
    "open('/work/left', 'w').write('x'); open('/tmp/left', 'w').write('x'); open('/dev/shm/left', 'w').write('x')\n"
    "ctypes.CDLL(None).shmget(0, 4096, 0o1600)\n"  # IPC_PRIVATE | IPC_CREAT
    "subprocess.Popen(['sleep', '300'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)\n"
    "print('left')\n"
)
KILL_PARENT = (
    "import os, signal, sys, time\n"
    "pp = os.getppid()\n"
    "print('start', flush=True)\n"
    "if pp > 1:\n"  # one exec per program: the parent is outside the container (0)
    "    os.kill(pp, signal.SIGKILL)\n"
    "time.sleep(0.3)\n"
    "print('end')\n"
)

PROGRAMS = [
    ExecSpec(cmd=["python3", "-c", "print('hello')"]),
    ExecSpec(cmd="echo to-stderr >&2; exit 3"),
    ExecSpec(cmd=["python3", "-c", "print('spin', flush=True)\nwhile True: pass"], timeout=10),
    ExecSpec(cmd=["python3", "-c", "import ctypes; print('crash', flush=True); ctypes.string_at(0)"]),
    ExecSpec(cmd=["python3", "-c", "b = bytearray(512 << 20); print(len(b))"]),
    ExecSpec(cmd=["python3", "-c", "import sys; sys.stdout.write('a' * 5000); sys.stderr.write('b' * 700)"]),
    ExecSpec(cmd="cat; echo \"$FOO\"; pwd", stdin=b"in-data\n", env={"FOO": "bar"}, workdir="/tmp"),
    ExecSpec(cmd="cat pkg/m.txt /tmp/t.bin; stat -c '%u %a' pkg/m.txt", files={"pkg/m.txt": "module\n", "/tmp/t.bin": b"\x00\x01"}),
    ExecSpec(cmd=["python3", "-c", "import sys; print(sys.stdin.read() == '')"]),
    ExecSpec(cmd=["python3", "-c", LEAVE]),
    ExecSpec(cmd=["python3", "-c", LOOK]),
    ExecSpec(cmd=["cat"], stdin=bytes(range(256)) * 800),  # 200 KiB in while output is read
    ExecSpec(cmd=["python3", "-c", "import os; print(sorted(os.environ.items()))"], env={"EXTRA": "1"}),
    ExecSpec(cmd="echo bye; exec >&- 2>&-; sleep 60", timeout=5),  # streams closed, still running
    ExecSpec(cmd="(sleep 0.5; echo late) & echo early"),  # a child keeps stdout open after exit
]
OVER_LIMIT = ExecSpec(cmd=["python3", "-c", "import sys\nwhile True: sys.stdout.write('z' * 65536)"], timeout=30)
KILLERS = [
    ExecSpec(cmd=["python3", "-c", KILL_PARENT]),
    ExecSpec(cmd="kill -9 -1; echo survived-own-kill"),
    ExecSpec(cmd=["python3", "-c", LOOK]),
]


async def one_exec_each(sb, programs):
    """The reference: each program alone, by ``exec``, in a freshly reset sandbox."""
    out = []
    for p in programs:
        assert await sb.reset()
        if p.files:
            await sb.write_files(dict(p.files))
        out.append(await sb.exec(p.cmd, timeout=p.timeout, stdin=p.stdin, env=p.env, workdir=p.workdir))
    return out


def same(a, b, fields=FIELDS, what="") -> None:
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}, what


async def test_a_batch_equals_one_exec_per_program(engine, image, ownership):
    with trio.fail_after(600):
        async with open_sandbox(engine, image=image, limits=LIM, ownership=ownership) as sb:
            batch = await sb.exec_many(PROGRAMS + [OVER_LIMIT])
            assert sb.batch_reruns == 0  # the runner reported every program itself
            ref = await one_exec_each(sb, PROGRAMS + [OVER_LIMIT])
    for i, (b, r) in enumerate(zip(batch[:-1], ref[:-1])):
        same(b, r, what=f"program {i}: {PROGRAMS[i].cmd!r}")
    # what each one did, so that "equal" is not "equally broken"
    assert batch[0].stdout == b"hello\n" and batch[0].ok
    assert (batch[1].exit_code, batch[1].stderr) == (3, b"to-stderr\n")
    assert batch[2].timed_out and batch[2].exit_code == 137 and batch[2].stdout == b"spin\n"
    assert batch[3].exit_code == 139 and batch[3].stdout == b"crash\n"
    assert batch[4].exit_code == 137 and batch[4].oom_killed and not batch[4].timed_out
    assert batch[5].stdout == b"a" * 1000 and batch[5].stdout_bytes == 5000 and batch[5].stdout_truncated
    assert batch[5].stderr == b"b" * 300 and batch[5].stderr_bytes == 700 and batch[5].ok
    assert batch[6].stdout == b"in-data\nbar\n/tmp\n"
    assert batch[7].stdout == b"module\n\x00\x011000 644\n"
    assert batch[8].stdout == b"True\n"
    assert batch[9].stdout == b"left\n"
    assert batch[10].stdout == b"[] [] []\n0\n[]\n"  # nothing of the program before it
    assert batch[11].stdout == bytes(range(256)) * 3 + bytes(range(232)) and batch[11].stdout_bytes == 204800
    assert b"('EXTRA', '1')" in batch[12].stdout and b"('HOME', '/home/sandbox')" in batch[12].stdout
    assert batch[13].timed_out and batch[13].exit_code == 137 and batch[13].stdout == b"bye\n"
    assert batch[14].stdout == b"early\nlate\n" and batch[14].ok
    # past the output limit every process is killed; the counts depend on timing
    b, r = batch[-1], ref[-1]
    assert b.output_limit_exceeded and r.output_limit_exceeded and not b.timed_out
    same(b, r, ("exit_code", "stdout", "stdout_truncated", "stderr", "timed_out", "oom_killed"))


async def test_programs_that_kill_the_runner_get_their_own_results(engine, image, ownership):
    progs = [PROGRAMS[0], *KILLERS, PROGRAMS[1]]
    with trio.fail_after(600):
        async with open_sandbox(engine, image=image, limits=LIM, ownership=ownership) as sb:
            batch = await sb.exec_many(progs, final=True)
            assert sb.batch_reruns == 4  # the killer of the parent and everything after it
            assert not sb.clean  # programs were rerun: the pool resets it as usual
            ref = await one_exec_each(sb, progs)
    for i, (b, r) in enumerate(zip(batch, ref)):
        same(b, r, what=f"program {i}: {progs[i].cmd!r}")
    assert batch[1].stdout == b"start\nend\n" and batch[1].ok
    assert batch[2].stdout == b"survived-own-kill\n"
    assert batch[3].stdout == b"[] [] []\n0\n[]\n" and batch[4].exit_code == 3


FORGER = r"""
import os, signal, sys
pp = os.getppid()
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT, signal.SIGALRM):
    os.kill(pp, sig)
fake = b'R {"i":2,"exit_code":0,"timed_out":false,"over_limit":false,"oom":false,"oom_count":0,"duration":0.0,"out_total":6,"err_total":0,"out_len":6,"err_len":0}\nforged'
for what in ("fd/1", "fd/0", "mem", "environ"):
    try:
        with open(f"/proc/{pp}/{what}", "r+b" if what != "environ" else "rb") as f:
            print(what, "OPENED")
    except PermissionError:
        print(what, "denied")
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, pp, None, None) == 0:  # PTRACE_ATTACH
    print("ptrace ATTACHED")
    libc.ptrace(17, pp, None, None)  # PTRACE_DETACH
else:
    print("ptrace denied", ctypes.get_errno())
sys.stdout.flush()
os.write(1, b"\n" + fake)
"""


async def test_a_program_cannot_forge_or_end_the_runners_report(engine, image, ownership):
    progs = [ExecSpec(cmd=["python3", "-c", FORGER]), ExecSpec(cmd="echo real"), ExecSpec(cmd="exit 5")]
    with trio.fail_after(300):
        async with open_sandbox(engine, image=image, limits=LIM, ownership=ownership) as sb:
            r = await sb.exec_many(progs, final=True)
            assert sb.batch_reruns == 0 and sb.clean  # the signals did not end the runner
    lines = r[0].stdout.decode().splitlines()
    assert lines[:5] == ["fd/1 denied", "fd/0 denied", "mem denied", "environ denied", "ptrace denied 1"], lines
    assert r[0].stdout.endswith(b"forged")  # only in its own output
    assert r[1].stdout == b"real\n" and r[1].ok
    assert r[2].exit_code == 5 and r[2].stdout == b""


async def test_a_final_batch_leaves_the_sandbox_clean_and_counts_each_program(engine, image, ownership):
    with trio.fail_after(300):
        async with open_sandbox_pool(ownership, engine=engine) as pool:
            async with pool.lease(image, LIM) as sb:
                r = await sb.exec_many([ExecSpec(cmd=["python3", "-c", LEAVE]), ExecSpec(cmd="true")], final=True)
                assert [x.exit_code for x in r] == [0, 0] and sb.clean
                look = await sb.exec(["python3", "-c", LOOK])
                assert look.stdout == b"[] [] []\n0\n[]\n"
                assert not sb.clean
                assert await sb.exec_many([]) == []
            assert pool.statistics().execs == 3


async def test_bad_programs_are_rejected_naming_the_index(engine, image, ownership):
    with trio.fail_after(300):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            ok = ExecSpec(cmd="true")
            with pytest.raises(ValueError, match=r"programs\[1\].*timeout"):
                await sb.exec_many([ok, ExecSpec(cmd="true", timeout=0)])
            with pytest.raises(ValueError, match=r"programs\[0\].*empty"):
                await sb.exec_many([ExecSpec(cmd="  ")])
            with pytest.raises(ValueError, match=r"programs\[0\].*outside the work dir"):
                await sb.exec_many([ExecSpec(cmd="true", files={"/etc/x": b""})])
            with pytest.raises(ValueError, match=r"programs\[0\].*env"):
                await sb.exec_many([ExecSpec(cmd="true", env={"A=B": "x"})])
            with pytest.raises(TypeError, match=r"programs\[0\]: files must be a mapping"):
                await sb.exec_many([ExecSpec(cmd="true", files=[("a", b"")])])  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"programs\[2\] must be an ExecSpec"):
                await sb.exec_many([ok, ok, "true"])  # type: ignore[list-item]
            assert [x.ok for x in await sb.exec_many([ok])] == [True]
