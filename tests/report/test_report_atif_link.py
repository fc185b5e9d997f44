"""The report's run page links the environment workers' ATIF files (``<state>/trajectories``)
beside the rollouts trained, by a relative link that resolves; no files, no row."""

from __future__ import annotations

from fleetrl.actors.report import write_report

from .test_report import _table


def test_the_run_page_links_the_rollout_files(make_state, h, tmp_path):
    state = make_state(steps=[h.step_metrics(i) for i in range(1, 4)])
    tdir = state / "trajectories" / "env"
    tdir.mkdir(parents=True)
    for i in range(3):
        (tdir / f"a{i}.atif.json").write_text("{}")
    (tdir / "notes.txt").write_text("not a trajectory")
    page = write_report(state, tmp_path / "out")
    table, links = _table(page)
    label = "rollout trajectories (ATIF files)"
    assert list(table).index(label) == list(table).index("rollouts trained") + 1
    assert table[label].startswith("3 files in ")
    (link,) = [x for x in links if "trajectories" in x]
    assert not link.startswith(("/", "http")) and (page.parent / link).resolve() == (state / "trajectories").resolve()


def test_no_row_without_files(make_state, h, tmp_path):
    state = make_state(steps=[h.step_metrics(1)])
    (state / "trajectories").mkdir()
    table, _ = _table(write_report(state, tmp_path / "out"))
    assert "rollout trajectories (ATIF files)" not in table
