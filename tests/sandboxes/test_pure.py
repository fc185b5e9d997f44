"""Pure parts of fleetrl.sandboxes: limits, recipe hash, mirror parsing, warm-pool
sizing, ownership labels, the HumanEval program. No Docker needed."""

from __future__ import annotations

import hashlib
import os

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.sandboxes import DEFAULT_LIMITS, ImageRecipe, Limits, Ownership, WarmPolicy, parse_size, recipe_hash
from fleetrl.sandboxes.humaneval import check_program, completion_for, summarize, ProblemResult
from fleetrl.sandboxes.image import default_mirror
from fleetrl.sandboxes.limits import host_config_kwargs
from fleetrl.sandboxes.checks import argv_of, env_list
from fleetrl.sandboxes.programs import oom_count
from fleetrl.sandboxes.sweep import state_hash
from fleetrl.sandboxes.transport import Capture
from fleetrl.sandboxes.warm import DemandTracker


# -- limits ------------------------------------------------------------------------------


def test_default_limits_are_safe():
    hc = host_config_kwargs(DEFAULT_LIMITS)
    assert hc["network_mode"] == "none"
    assert hc["read_only"] is True
    assert hc["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in hc["security_opt"]
    assert hc["memswap_limit"] == hc["mem_limit"] == 512 << 20  # no swap
    assert hc["pids_limit"] == 256
    assert hc["nano_cpus"] == 1_000_000_000
    names = {u["Name"]: u for u in hc["ulimits"]}
    assert names["nofile"]["Hard"] == 1024 and names["fsize"]["Soft"] == DEFAULT_LIMITS.fsize_bytes
    assert set(hc["tmpfs"]) == {"/tmp", "/work"}
    assert "uid=1000" in hc["tmpfs"]["/work"]
    assert DEFAULT_LIMITS.uid == 1000 and DEFAULT_LIMITS.gid == 1000


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_bytes", 1),
        ("cpus", 0.0),
        ("pids", 2),
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("stdout_cap", -1),
        ("nofile", 1 << 30),
        ("workdir", "relative"),
        ("workdir", "/"),
        ("workdir", "/tmp"),
        ("workdir", "/a/../etc"),
        ("user", "0:0"),
        ("user", "1000"),
        ("user", "root:root"),
        ("network", "host"),
    ],
)
def test_limits_reject_bad_values_naming_the_field(field, value):
    with pytest.raises((ValueError, msgspec.ValidationError, TypeError)) as ei:
        msgspec.convert({field: value}, Limits)
    assert field in str(ei.value)


def test_limits_from_untrusted_config_rejects_unknown_fields():
    with pytest.raises(msgspec.ValidationError, match="memroy_bytes"):
        msgspec.convert({"memroy_bytes": 1 << 30}, Limits)
    assert msgspec.convert({"memory_bytes": 1 << 30}, Limits).memory_bytes == 1 << 30


def test_limits_are_hashable_pool_keys():
    a, b = Limits(pids=64), Limits(pids=64)
    assert a == b and hash(a) == hash(b) and a != DEFAULT_LIMITS


@given(st.integers(min_value=0, max_value=1 << 40), st.sampled_from(["", "k", "m", "g", "K", "M", "G", "mb", "MiB"]))
def test_parse_size_units(n, unit):
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "mb": 1 << 20, "mib": 1 << 20}[unit.lower()]
    assert parse_size(f"{n}{unit}") == n * mult


@pytest.mark.parametrize("bad", ["", "abc", "12q", "-5m", "m"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


# -- image recipe ------------------------------------------------------------------------


def test_recipe_hash_ignores_package_order_and_tracks_content():
    a = ImageRecipe(packages=("python3", "git"))
    b = ImageRecipe(packages=("git", "python3"))
    assert recipe_hash(a) == recipe_hash(b)
    assert recipe_hash(a) != recipe_hash(a.with_extra_packages(["jq"]))
    assert recipe_hash(a) != recipe_hash(ImageRecipe(packages=("python3", "git"), uid=1001))
    assert len(recipe_hash(a)) == 16 and int(recipe_hash(a), 16) >= 0
    assert recipe_hash(a.with_extra_packages(["git", " "])) == recipe_hash(a)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"packages": ("python3", "rm -rf /")}, "packages"),
        ({"packages": ("Python3",)}, "packages"),
        ({"user": "root"}, "user"),
        ({"uid": 0}, "uid"),
        ({"suite": "../x"}, "suite"),
        ({"variant": "fat"}, "variant"),
        ({"workdir": "/"}, "workdir"),
    ],
)
def test_recipe_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        ImageRecipe(**kw)


def test_default_mirror_reads_deb822_and_one_line_sources(tmp_path):
    a = tmp_path / "a.sources"
    a.write_text(
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
    )
    b = tmp_path / "b.list"
    b.write_text("# comment\ndeb [arch=amd64] http://other.example/debian/ bookworm main\n")
    assert default_mirror((a, b)) == "http://mirror.example/debian"
    assert default_mirror((b,)) == "http://other.example/debian"
    assert default_mirror((tmp_path / "missing",)) == "http://deb.debian.org/debian"


# -- warm pool sizing --------------------------------------------------------------------


def test_warm_policy_bounds():
    with pytest.raises(ValueError, match="min_warm"):
        WarmPolicy(min_warm=5, max_warm=2)
    with pytest.raises(ValueError, match="max_containers"):
        WarmPolicy(max_warm=10, max_containers=5)
    with pytest.raises(ValueError, match="window_s"):
        WarmPolicy(window_s=0)


def test_demand_peak_holds_for_the_window_then_decays():
    pol = WarmPolicy(min_warm=1, max_warm=6, window_s=10, headroom=0)
    d = DemandTracker(pol)
    d.record(0.0, 1)
    d.record(1.0, 5)
    d.record(2.0, 2)
    assert d.target_warm(3.0) == 5
    assert d.target_warm(11.5) == 5  # the 5 was in effect until t=2, inside (1.5, 11.5]
    assert d.target_warm(12.5) == 2
    d.record(13.0, 0)
    assert d.target_warm(30.0) == 1  # floor: min_warm
    d.record(31.0, 50)
    assert d.target_warm(31.0) == 6  # ceiling: max_warm


def test_headroom_covers_leases_arriving_during_resets():
    d = DemandTracker(WarmPolicy(min_warm=0, max_warm=32, headroom=1.0))
    d.record(0.0, 3)
    assert d.target_warm(0.5) == 6  # 3 leased + 3 being reset or idle
    d = DemandTracker(WarmPolicy(min_warm=0, max_warm=32, headroom=0.5))
    d.record(0.0, 3)
    assert d.target_warm(0.5) == 5  # ceil(4.5)
    with pytest.raises(ValueError, match="headroom"):
        WarmPolicy(headroom=-1)


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.floats(0, 5, allow_nan=False), st.integers(0, 40)), max_size=40),
    st.integers(0, 4),
    st.integers(0, 8),
)
def test_demand_target_always_within_bounds_and_covers_the_latest_level(steps, lo, extra):
    pol = WarmPolicy(min_warm=lo, max_warm=lo + extra, window_s=7, headroom=float(extra % 3))
    d = DemandTracker(pol)
    now = 0.0
    for dt, leased in steps:
        now += dt
        d.record(now, leased)
        t = d.target_warm(now)
        assert pol.min_warm <= t <= pol.max_warm
        assert t >= min(leased, pol.max_warm)  # the level now is part of the recent peak


# -- ownership ---------------------------------------------------------------------------


def test_ownership_labels_follow_the_contract(tmp_path):
    sd = tmp_path / "s"
    sd.mkdir()
    (sd / "run_id").write_text("run-42\n")
    link = tmp_path / "link"
    link.symlink_to(sd)
    own = Ownership.for_state_dir(link, owner="inst-1")
    assert own.state == hashlib.sha256(os.path.realpath(sd).encode()).hexdigest()[:16] == state_hash(sd)
    labels = own.labels(now=123.5)
    assert labels == {
        "fleetrl.owner": "inst-1",
        "fleetrl.run": "run-42",
        "fleetrl.state": own.state,
        "fleetrl.created": "123.500",
    }
    assert Ownership.for_state_dir(tmp_path / "nope", owner="x").run == "adhoc"
    with pytest.raises(ValueError, match="owner"):
        Ownership(owner="a\nb", run="r", state="s")


# -- exec helpers ------------------------------------------------------------------------


@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(max_size=50)), max_size=30), st.integers(0, 200))
def test_capture_keeps_a_prefix_and_counts_everything(frames, cap_n):
    cap = Capture(cap_n, cap_n)
    for stream, data in frames:
        cap.add(stream, memoryview(data))
    out = b"".join(d for s, d in frames if s == 1)
    err = b"".join(d for s, d in frames if s == 2)
    assert bytes(cap.out) == out[:cap_n] and cap.out_total == len(out)
    assert bytes(cap.err) == err[:cap_n] and cap.err_total == len(err)


def test_oom_count_parses_cgroup_v1_and_v2():
    assert oom_count("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert oom_count("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n") == 2
    assert oom_count("") == 0


def test_exec_argument_checks():
    assert argv_of("echo hi") == ["/bin/sh", "-c", "echo hi"]
    assert argv_of(("ls", "-l")) == ["ls", "-l"]
    for bad in ("", "   ", [], ["a", 1], ["a\0b"]):
        with pytest.raises(ValueError, match="Sandbox.exec"):
            argv_of(bad)
    assert env_list({"A": "1"}) == ["A=1"]
    for bad in ({"": "x"}, {"A=B": "x"}, {"A": "x\0"}):
        with pytest.raises(ValueError, match="env"):
            env_list(bad)


# -- humaneval program --------------------------------------------------------------------


def test_check_program_matches_the_package_evaluator():
    p = {"task_id": "T/0", "prompt": "def f(x):\n", "test": "def check(c):\n    assert c(2) == 4\n", "entry_point": "f",
         "canonical_solution": "    return 2 * x\n"}
    prog = check_program(p, completion_for(p, "canonical"))
    scope: dict = {}
    exec(prog, scope)  # the canonical program passes
    with pytest.raises(AssertionError):
        exec(check_program(p, completion_for(p, "empty")), {})
    with pytest.raises(ValueError, match="solutions"):
        completion_for(p, "best")
    s = summarize("canonical", [ProblemResult(task_id="T/0", passed=True, exit_code=0, timed_out=False, duration_s=0.1),
                                ProblemResult(task_id="T/1", passed=False, exit_code=1, timed_out=False, duration_s=0.1)], 2.0)
    assert (s.problems, s.passed, s.failed, s.failed_ids, s.problems_per_s) == (2, 1, 1, ("T/1",), 1.0)
