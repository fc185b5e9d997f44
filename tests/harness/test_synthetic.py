"""The synthetic coding tasks of the embedded default (fleetrl.harness.synthetic).

Checked here: the families' two definitions agree; shown and hidden examples identify
their target among every candidate (so look-alikes are told apart); tasks are
deterministic by seed, across processes too, and the stream resumes from a cursor;
the splits are disjoint by construction; reference solutions score 1.0 through the
real checker in a subprocess; wrong, junk, raising, looping and exiting completions
lose their points without hanging the checker.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.harness import synthetic as syn
from fleetrl.harness import synthetic_families as fam_mod
from fleetrl.harness.synthetic_families import FAMILIES, FAMILY_BY_NAME, X_MAX, X_MIN
from fleetrl.harness.tasks import Task, decode_task_json, encode_task_json

EXAMPLE = re.compile(r"^f\((-?\d+)\)=(-?\d+)$")
SPLIT_SIZES = {"train": 1500, "fresh": 300, "general": 300}


@pytest.fixture(scope="module")
def tasks_by_split() -> dict[str, list[Task]]:
    return {split: syn.generate_tasks(n, split=split, seed=11) for split, n in SPLIT_SIZES.items()}


def shown_examples(task: Task) -> list[tuple[int, int]]:
    """The examples as the model sees them, parsed from the prompt text."""
    assert task.prompt is not None
    lines = task.prompt.splitlines()
    assert len(lines) == 2 and lines[-1] == syn.SIGNATURE
    assert lines[0].startswith(syn.EXAMPLES_PREFIX)
    examples = []
    for item in lines[0].removeprefix(syn.EXAMPLES_PREFIX).split(" "):
        match = EXAMPLE.match(item)
        assert match is not None, item
        examples.append((int(match[1]), int(match[2])))
    return examples


def hidden_examples(task: Task) -> list[tuple[int, int]]:
    """The hidden tests, read from the generated checker's TESTS constant."""
    script = task.setup.files[syn.CHECK_FILE]
    match = re.search(r"^TESTS = (\[.*\])$", script, re.MULTILINE)
    assert match is not None
    return [(x, y) for x, y in ast.literal_eval(match[1])]


def target_of(task: Task) -> tuple[str, tuple[int, ...]]:
    fam = FAMILY_BY_NAME[str(task.metadata["family"])]
    pairs = dict(item.split("=") for item in str(task.metadata["params"]).split(","))
    return fam.name, tuple(int(pairs[n]) for n in fam.param_names)


def verdicts(stdout: str) -> dict[int, str]:
    """The checker's per-test verdicts: its 'synthetic check: x:verdict ...' line."""
    line = next(line for line in stdout.splitlines() if line.startswith("synthetic check: "))
    words = line.removeprefix("synthetic check: ").split(" (")[0].split()
    return {int(x): v for x, v in (w.split(":") for w in words)}


def score_many(pairs: list[tuple[Task, str]]) -> list[float]:
    # Each call is a few short processes; a small pool overlaps their start-up.
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda p: syn.score_completion_locally(*p), pairs))


# ---------------------------------------------------------------------------- families


def test_family_function_matches_reference_expression() -> None:
    for fam in FAMILIES:
        for params in fam.all_params():
            code = compile(fam.expression(params), fam.name, "eval")
            for x in range(X_MIN, X_MAX + 1):
                assert eval(code, {"x": x}) == fam(x, params), (fam.name, params, x)


@pytest.mark.parametrize(
    ("family", "params", "x", "y"),
    [
        ("add", (3,), 2, 5),
        ("sub", (4,), 1, -3),
        ("rsub", (8,), 10, -2),
        ("mul", (6,), 7, 42),
        ("absdiff", (5,), 2, 3),
        ("absdiff", (5,), 9, 4),
        ("max", (6,), 4, 6),
        ("max", (6,), 11, 11),
        ("min", (6,), 4, 4),
        ("min", (6,), 11, 6),
        ("mod", (7,), 20, 6),
        ("floordiv", (3,), 20, 6),
        ("affine", (2, 5), 3, 11),
    ],
)
def test_family_values_by_hand(family: str, params: tuple[int, ...], x: int, y: int) -> None:
    assert FAMILY_BY_NAME[family](x, params) == y


def test_family_set_is_small_and_each_family_has_held_out_parameters() -> None:
    assert 6 <= len(FAMILIES) <= 12
    assert len(FAMILY_BY_NAME) == len(FAMILIES)
    for fam in FAMILIES:
        assert fam.held_out, fam.name
        assert set(fam.held_out).isdisjoint(fam.train_params())
        assert sorted([*fam.held_out, *fam.train_params()]) == fam.all_params()


def test_every_held_out_constant_is_still_trained_with_another_family() -> None:
    trained_constants = {v for fam in FAMILIES for params in fam.train_params() for v in params}
    for fam in FAMILIES:
        for params in fam.held_out:
            assert set(params) <= trained_constants, (fam.name, params)


def test_family_spec_rejects_bad_definitions() -> None:
    with pytest.raises(ValueError, match="held-out parameters"):
        fam_mod.TaskFamilySpec("x", "x + {a}", lambda x, a: x + a, ("a",), ((1, 3),), ((9,),))
    with pytest.raises(ValueError, match="empty parameter range"):
        fam_mod.TaskFamilySpec("x", "x + {a}", lambda x, a: x + a, ("a",), ((3, 1),), ())
    with pytest.raises(ValueError, match="every parameter tuple is held out"):
        fam_mod.TaskFamilySpec("x", "x + {a}", lambda x, a: x + a, ("a",), ((1, 1),), ((1,),))
    with pytest.raises(ValueError, match="2 ranges"):
        fam_mod.TaskFamilySpec("x", "x + {a}", lambda x, a: x + a, ("a",), ((1, 2), (1, 2)), ())


def test_no_two_candidates_agree_on_the_hidden_range() -> None:
    # Hidden inputs never include the always-shown 0 and 1, so candidates must differ
    # somewhere on 2..X_MAX for hidden tests to be able to tell them apart.
    start = max(fam_mod.ALWAYS_SHOWN) + 1 - X_MIN
    rows = [row[start:] for row in fam_mod.CANDIDATE_VALUES]
    assert len(set(rows)) == len(rows) == len(fam_mod.CANDIDATES)


def test_every_candidate_is_identifiable() -> None:
    for name, params in fam_mod.CANDIDATES:
        for seed in range(3):
            drawn = fam_mod.draw_examples(random.Random(seed), FAMILY_BY_NAME[name], params)
            assert fam_mod.identifying_candidates(drawn.shown) == [(name, params)]
            assert fam_mod.identifying_candidates(drawn.hidden) == [(name, params)]


def test_identifying_candidates_rejects_inputs_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        fam_mod.identifying_candidates([(X_MAX + 1, 0)])


# ---------------------------------------------------------------------------- examples


def test_shown_inputs_include_zero_and_one_sorted_and_hidden_are_other_inputs(
    tasks_by_split: dict[str, list[Task]],
) -> None:
    for tasks in tasks_by_split.values():
        for task in tasks:
            shown = shown_examples(task)
            hidden = hidden_examples(task)
            xs = [x for x, _ in shown]
            assert len(xs) == fam_mod.N_SHOWN and xs[:2] == [0, 1] and xs == sorted(set(xs))
            hxs = [x for x, _ in hidden]
            assert len(hxs) == fam_mod.N_HIDDEN and hxs == sorted(set(hxs))
            assert set(xs).isdisjoint(hxs)
            assert all(X_MIN <= x <= X_MAX for x in xs + hxs)
            assert task.metadata["shown_inputs"] == ",".join(map(str, xs))
            assert task.metadata["hidden_inputs"] == ",".join(map(str, hxs))


def test_shown_examples_rule_out_every_other_family_and_parameter(
    tasks_by_split: dict[str, list[Task]],
) -> None:
    # Brute force with the families' own functions (not the module's lookup index):
    # for 200 tasks of each split, no other (family, parameters) pair in range --
    # held-out ones included -- satisfies the shown examples, and none satisfies the
    # hidden tests either, so a look-alike never earns full reward.
    for tasks in tasks_by_split.values():
        for task in tasks[:200]:
            target = target_of(task)
            for examples in (shown_examples(task), hidden_examples(task)):
                fits = [
                    (fam.name, params)
                    for fam in FAMILIES
                    for params in fam.all_params()
                    if all(fam(x, params) == y for x, y in examples)
                ]
                assert fits == [target], (task.id, examples)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(-(2**63), 2**63),
    index=st.integers(0, 2**31),
    split=st.sampled_from(fam_mod.SPLITS),
)
def test_any_task_satisfies_the_split_and_identification_invariants(seed: int, index: int, split: str) -> None:
    task = syn.make_task(seed, split, index)  # type: ignore[arg-type]
    target = target_of(task)
    fam = FAMILY_BY_NAME[target[0]]
    assert (target[1] in fam.held_out) == (split == "general")
    assert task.prompt is not None
    if split != "general":
        assert syn.is_eval_reserved(task.prompt) == (split == "fresh")
    shown, hidden = shown_examples(task), hidden_examples(task)
    assert all(fam(x, target[1]) == y for x, y in shown + hidden)
    assert fam_mod.identifying_candidates(shown) == [target]
    assert fam_mod.identifying_candidates(hidden) == [target]
    assert [x for x, _ in shown][:2] == [0, 1]


def test_look_alikes_share_f0_yet_are_told_apart(tasks_by_split: dict[str, list[Task]]) -> None:
    # abs(x - a), a - x and max(x, a) all give f(0) = a (and the first two f(1) too);
    # every such task shows an input where its look-alikes with the same a differ.
    look_alikes = ("absdiff", "rsub", "max")
    seen = 0
    for task in tasks_by_split["train"]:
        name, params = target_of(task)
        if name not in look_alikes:
            continue
        seen += 1
        for other in look_alikes:
            if other != name and params in FAMILY_BY_NAME[other].all_params():
                assert FAMILY_BY_NAME[other](0, params) == params[0]
                assert any(FAMILY_BY_NAME[other](x, params) != y for x, y in shown_examples(task))
    assert seen > 100


# ---------------------------------------------------------------------------- tasks


def test_tasks_are_valid_task_records_that_round_trip(tasks_by_split: dict[str, list[Task]]) -> None:
    for split, tasks in tasks_by_split.items():
        for task in tasks[:100]:
            assert decode_task_json(encode_task_json(task), where="test") == task
            assert task.source is not None and task.source.kind == "synthetic"
            assert task.evaluator.reward == "fraction"
            assert syn.CHECK_FILE in task.setup.files
            assert task.metadata["split"] == split
            assert task.id == f"synthetic/{split}/11/{task.metadata['index']}"


def test_prompt_is_short_and_ends_with_the_signature(tasks_by_split: dict[str, list[Task]]) -> None:
    for tasks in tasks_by_split.values():
        for task in tasks:
            assert task.prompt is not None
            assert len(task.prompt) <= 70  # compact: every byte is a token of the tiny model
            assert task.prompt.endswith(syn.SIGNATURE + "\n")
            assert syn.prompt_for(task) == task.prompt
            assert target_of(task)  # metadata names the target


def test_prompt_for_a_draw_lists_examples_in_order() -> None:
    drawn = fam_mod.DrawnTask("add", (3,), ((0, 3), (1, 4), (5, 8)), ())
    assert syn.prompt_for(drawn) == "# f(0)=3 f(1)=4 f(5)=8\ndef f(x):\n"
    negative = fam_mod.DrawnTask("sub", (3,), ((0, -3), (1, -2), (12, 9)), ())
    assert syn.prompt_for(negative) == "# f(0)=-3 f(1)=-2 f(12)=9\ndef f(x):\n"


def test_generation_is_deterministic_by_seed() -> None:
    for split in fam_mod.SPLITS:
        first = syn.generate_tasks(40, split=split, seed=3)
        assert first == syn.generate_tasks(40, split=split, seed=3)
        other = syn.generate_tasks(40, split=split, seed=4)
        assert [t.prompt for t in first] != [t.prompt for t in other]
    assert syn.generate_tasks(5, split="train", seed=3, start=20) == syn.generate_tasks(
        25, split="train", seed=3
    )[20:]


def _digest(seed: int) -> str:
    encoded = b"".join(
        encode_task_json(t) for split in fam_mod.SPLITS for t in syn.generate_tasks(30, split=split, seed=seed)
    )
    return hashlib.sha256(encoded).hexdigest()


def test_generation_is_identical_in_another_process_with_another_hash_seed() -> None:
    script = (
        "import hashlib, sys\n"
        "from fleetrl.harness import synthetic as syn\n"
        "from fleetrl.harness.tasks import encode_task_json\n"
        "enc = b''.join(encode_task_json(t) for split in ('train', 'fresh', 'general')"
        " for t in syn.generate_tasks(30, split=split, seed=int(sys.argv[1])))\n"
        "print(hashlib.sha256(enc).hexdigest())\n"
    )
    for hash_seed in ("1", "987"):
        out = subprocess.run(
            [sys.executable, "-c", script, "5"],
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.strip() == _digest(5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(-(2**40), 2**40), start=st.integers(0, 300), k=st.integers(0, 12))
def test_stream_resumes_from_its_cursor(seed: int, start: int, k: int) -> None:
    stream = syn.task_stream(seed)
    assert stream.cursor == 0
    for _ in range(start % 7):
        next(stream)
    skipped = start % 7
    assert stream.cursor == skipped
    resumed = syn.task_stream(seed, start=stream.cursor)
    ahead = [next(stream) for _ in range(k)]
    assert [next(resumed) for _ in range(k)] == ahead
    assert stream.cursor == resumed.cursor == skipped + k
    assert syn.generate_tasks(k, split="train", seed=seed, start=skipped) == ahead
    far = syn.task_stream(seed, start=start)
    assert next(far) == syn.make_task(seed, "train", start)
    assert far.cursor == start + 1


def test_stream_is_the_training_split() -> None:
    stream = syn.task_stream(2)
    assert [next(stream) for _ in range(10)] == syn.generate_tasks(10, split="train", seed=2)
    assert iter(stream) is stream


# ---------------------------------------------------------------------------- splits


def test_splits_are_disjoint_by_construction(tasks_by_split: dict[str, list[Task]]) -> None:
    held = {(fam.name, p) for fam in FAMILIES for p in fam.held_out}
    for split, tasks in tasks_by_split.items():
        for task in tasks:
            assert task.prompt is not None
            in_held = target_of(task) in held
            assert in_held == (split == "general"), task.id
            if split != "general":
                assert syn.is_eval_reserved(task.prompt) == (split == "fresh"), task.id
    prompts = {split: {t.prompt for t in tasks} for split, tasks in tasks_by_split.items()}
    assert prompts["train"].isdisjoint(prompts["fresh"])
    assert prompts["train"].isdisjoint(prompts["general"])
    assert prompts["fresh"].isdisjoint(prompts["general"])
    # and the training stream of other seeds never produces an evaluation prompt
    for seed in (0, 1):
        for task in syn.generate_tasks(300, split="train", seed=seed):
            assert task.prompt is not None and not syn.is_eval_reserved(task.prompt)
            assert target_of(task) not in held


def test_evaluation_splits_cover_the_families_and_held_out_pairs(
    tasks_by_split: dict[str, list[Task]],
) -> None:
    held = {(fam.name, p) for fam in FAMILIES for p in fam.held_out}
    general_targets = {target_of(t) for t in tasks_by_split["general"]}
    assert general_targets <= held
    assert len(general_targets) >= len(held) - 2  # 300 draws over the held-out pairs
    for split in ("train", "fresh"):
        counts = Counter(str(t.metadata["family"]) for t in tasks_by_split[split])
        assert set(counts) == set(FAMILY_BY_NAME)
        share = {name: n / len(tasks_by_split[split]) for name, n in counts.items()}
        assert all(0.03 < s < 0.2 for s in share.values()), share  # uniform is 0.1


def test_fresh_tasks_use_new_parameters_and_inputs_of_the_same_ranges(
    tasks_by_split: dict[str, list[Task]],
) -> None:
    train = {(target_of(t), t.metadata["shown_inputs"]) for t in tasks_by_split["train"]}
    fresh = [(target_of(t), t.metadata["shown_inputs"]) for t in tasks_by_split["fresh"]]
    assert not any(item in train for item in fresh)
    train_params = {(fam.name, p) for fam in FAMILIES for p in fam.train_params()}
    assert {target for target, _ in fresh} <= train_params


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        syn.generate_tasks(1, split="test", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        syn.generate_tasks(-1, split="train", seed=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        syn.generate_tasks(1, split="train", seed="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start must be"):
        syn.task_stream(0, start=-1)
    with pytest.raises(ValueError, match="index must be"):
        syn.make_task(0, "train", -3)
    with pytest.raises(ValueError, match="budget_s"):
        syn.CheckConfig(budget_s=40.0, evaluator_timeout_s=30.0)
    with pytest.raises(ValueError, match="per_test_s"):
        syn.CheckConfig(per_test_s=0.0)


def test_non_synthetic_tasks_are_rejected_with_the_field() -> None:
    task = syn.generate_tasks(1, split="train", seed=0)[0]
    user = msgspec.structs.replace(task, source=None)
    with pytest.raises(syn.SyntheticTaskError, match="not a synthetic task"):
        syn.reference_solution(user)
    bad_family = msgspec.structs.replace(task, metadata={**task.metadata, "family": "pow"})
    with pytest.raises(syn.SyntheticTaskError, match="metadata.family"):
        syn.reference_solution(bad_family)
    bad_params = msgspec.structs.replace(task, metadata={**task.metadata, "params": "b=x"})
    with pytest.raises(syn.SyntheticTaskError, match="metadata.params"):
        syn.score_completion_locally(bad_params, "    return 1\n")


# ---------------------------------------------------------------------------- scoring


def test_reference_solution_format() -> None:
    for task in syn.generate_tasks(30, split="train", seed=1):
        ref = syn.reference_solution(task)
        assert ref.startswith("    return ") and ref.endswith("\n" + syn.STOP_MARKER)
        assert ref.count("\n") == 1
        name, params = target_of(task)
        assert ref == f"    return {FAMILY_BY_NAME[name].expression(params)}\n<eos>"


@pytest.mark.slow
def test_reference_solutions_score_one_for_200_tasks_of_each_split() -> None:
    pairs = [
        (task, syn.reference_solution(task))
        for split in fam_mod.SPLITS
        for task in syn.generate_tasks(200, split=split, seed=23)
    ]
    scores = score_many(pairs)
    assert scores == [1.0] * len(pairs), [t.id for (t, _), s in zip(pairs, scores) if s != 1.0]


def test_wrong_families_score_below_one() -> None:
    rng = random.Random(5)
    pairs = []
    for task in syn.generate_tasks(40, split="fresh", seed=9):
        name, params = target_of(task)
        others = [(f, p) for f in FAMILIES for p in f.all_params() if (f.name, p) != (name, params)]
        # a look-alike with the same constant where one exists, else any other pair
        same_constant = [(f, p) for f, p in others if p[:1] == params[:1] and f.name != name]
        other, other_params = rng.choice(same_constant or others)
        pairs.append((task, f"    return {other.expression(other_params)}\n<eos>"))
    assert all(score < 1.0 for score in score_many(pairs))


def test_partial_solution_scores_its_fraction() -> None:
    task = syn.generate_tasks(1, split="train", seed=1)[0]
    name, params = target_of(task)
    expr = FAMILY_BY_NAME[name].expression(params)
    hidden = hidden_examples(task)
    cut = hidden[len(hidden) // 2][0]
    completion = f"    return ({expr}) if x < {cut} else 10**6\n<eos>"
    expected = sum(1 for x, _ in hidden if x < cut) / len(hidden)
    assert 0 < expected < 1
    assert syn.score_completion_locally(task, completion) == expected


def test_right_values_of_the_wrong_type_fail() -> None:
    task = syn.generate_tasks(1, split="train", seed=1)[0]
    name, params = target_of(task)
    expr = FAMILY_BY_NAME[name].expression(params)
    assert syn.score_completion_locally(task, f"    return float({expr})\n") == 0.0
    assert syn.score_completion_locally(task, f"    return str({expr})\n") == 0.0
    assert syn.score_completion_locally(task, f"    return int({expr})\n") == 1.0


JUNK = {
    "empty": "",
    "not python": "junk junk ((",
    "unindented": "return x\n",
    "raises": "    raise ValueError('no')\n",
    "zero division": "    return x // 0\n",
    "prints junk": "    print('#' * 100000)\n    return None\n",
    "prints a fake reward": "    return None\nprint('8/8')\nimport os\nos.write(1, b'8/8\\n')\n",
    "float": "    return float(x) * 1e9\n",
    "bool": "    return True\n",
    "exits": "    raise SystemExit(0)\n",
    "hard exit": "    import os\n    os._exit(0)\n",
    "memory bomb": "    return len([0] * 10**10)\n",
    "redefines f": "    return x\nf = None\n",
    "huge int": "    return 10**100000\n",
}


@pytest.mark.parametrize("kind", sorted(JUNK))
def test_junk_completions_score_zero(kind: str) -> None:
    task = syn.generate_tasks(1, split="train", seed=4)[0]
    assert syn.score_completion_locally(task, JUNK[kind]) == 0.0


def test_looping_completion_scores_zero_by_per_test_timeouts() -> None:
    task = syn.generate_tasks(1, split="train", seed=4)[0]
    done = syn.run_check_locally(task, syn.solution_text(task, "    while True:\n        pass\n"))
    assert done.stdout.strip().splitlines()[-1] == f"0/{fam_mod.N_HIDDEN}"
    assert set(verdicts(done.stdout).values()) == {"timeout"}


def test_loop_on_some_inputs_only_costs_those_tests() -> None:
    task = syn.generate_tasks(1, split="train", seed=4)[0]
    name, params = target_of(task)
    hidden = hidden_examples(task)
    slow = {hidden[1][0], hidden[5][0]}
    body = (
        f"    while x in {sorted(slow)!r}:\n        pass\n"
        f"    return {FAMILY_BY_NAME[name].expression(params)}\n"
    )
    done = syn.run_check_locally(task, syn.solution_text(task, body))
    assert done.stdout.strip().splitlines()[-1] == f"{len(hidden) - 2}/{len(hidden)}"
    assert verdicts(done.stdout) == {x: "timeout" if x in slow else "pass" for x, _ in hidden}


def test_loop_while_loading_scores_zero() -> None:
    task = syn.generate_tasks(1, split="train", seed=4)[0]
    done = syn.run_check_locally(task, syn.solution_text(task, "    return x\nwhile True:\n    pass\n"))
    assert done.stdout.strip().splitlines()[-1] == f"0/{fam_mod.N_HIDDEN}"
    assert "load failed: no answer" in done.stdout


def test_solution_file_conventions() -> None:
    # The harness writes prompt + completion; a bare body or a whole module also work;
    # the stop marker ends the solution, and what follows it is ignored.
    task = syn.generate_tasks(1, split="general", seed=2)[0]
    name, params = target_of(task)
    expr = FAMILY_BY_NAME[name].expression(params)
    assert task.prompt is not None
    for solution, want in [
        (task.prompt + f"    return {expr}\n", 1.0),
        (f"    return {expr}\n", 1.0),
        (f"def f(x):\n    return {expr}\n", 1.0),
        (f"def g(x):\n    return {expr}\n", 0.0),
        (task.prompt + f"    return {expr}\n<eos>\ndef f(x):\n    return 0\n", 1.0),
        (task.prompt + "    return 0\n<eos>\n" + f"    return {expr}\n", 0.0),
    ]:
        done = syn.run_check_locally(task, solution)
        last = done.stdout.strip().splitlines()[-1]
        passed, total = map(int, last.split("/"))
        assert passed / total == want, (solution, done.stdout)


def test_missing_solution_file_scores_zero() -> None:
    task = syn.generate_tasks(1, split="train", seed=4)[0]
    task = msgspec.structs.replace(
        task,
        evaluator=msgspec.structs.replace(task.evaluator, command=f"rm {syn.SOLUTION_FILE} && " + task.evaluator.command),
    )
    done = syn.run_check_locally(task, "    return x\n")
    assert done.stdout.strip().splitlines()[-1] == f"0/{fam_mod.N_HIDDEN}"
    assert "cannot read solution.py" in done.stdout


# ---------------------------------------------------------------------------- in a sandbox


@pytest.mark.docker
async def test_checker_in_the_real_sandbox_matches_local_scores(tmp_path) -> None:
    # The evaluator as the environment workers run it: setup files and solution.py
    # written into a hardened sandbox (read-only root, unprivileged, pids and memory
    # limits), the command run with sh -c in the workdir, the reward read from stdout.
    import secrets

    import docker
    import trio

    from fleetrl.harness.tasks import reward_from_evaluator
    from fleetrl.sandboxes import DEFAULT_IMAGE, Engine, Ownership, ensure_image, open_sandbox
    from fleetrl.sandboxes.sweep import LABEL_OWNER

    task = syn.generate_tasks(1, split="fresh", seed=6)[0]
    assert task.image == DEFAULT_IMAGE and task.workdir == "/work"
    name, params = target_of(task)
    hidden = hidden_examples(task)
    cut = hidden[4][0]
    expr = FAMILY_BY_NAME[name].expression(params)
    completions = {
        "reference": syn.reference_solution(task),
        "half": f"    return ({expr}) if x < {cut} else None\n<eos>",
        "junk": "    print('junk'); return 1/0\n",
        "fork and exit": "    import os\n    if os.fork() == 0:\n        os._exit(0)\n    os._exit(1)\n",
        "memory bomb": "    return len(bytearray(10**9))\n",
        "loop": "    while True:\n        pass\n",
    }
    want = {key: syn.score_completion_locally(task, c) for key, c in completions.items()}
    assert want["reference"] == 1.0 and want["half"] == 0.5
    assert {want[k] for k in ("junk", "fork and exit", "memory bomb", "loop")} == {0.0}

    client = docker.from_env()
    ensure_image(DEFAULT_IMAGE, client=client)
    owner = f"test-synthetic-{secrets.token_hex(4)}"
    ownership = Ownership.for_state_dir(tmp_path, owner=owner, run="test-run")
    got: dict[str, float] = {}
    try:
        with trio.fail_after(180):
            async with open_sandbox(Engine(client), image=DEFAULT_IMAGE, ownership=ownership) as sb:
                for key, completion in completions.items():
                    await sb.write_files(
                        {**task.setup.files, syn.SOLUTION_FILE: syn.solution_text(task, completion)}
                    )
                    result = await sb.exec(task.evaluator.command, timeout=task.evaluator.timeout_s)
                    assert not result.timed_out, key
                    got[key] = reward_from_evaluator(
                        task, result.exit_code or 0, result.stdout.decode("utf-8", "replace")
                    )
    finally:
        left = client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={owner}"})
        for container in left:
            container.remove(force=True)
        client.close()
    assert not left, "sandbox container left behind"
    assert got == want


def test_check_config_reaches_the_task() -> None:
    check = syn.CheckConfig(per_test_s=0.25, budget_s=20.0, evaluator_timeout_s=40.0)
    task = syn.generate_tasks(1, split="train", seed=4, check=check)[0]
    script = task.setup.files[syn.CHECK_FILE]
    assert "\nPER_TEST_S = 0.25\n" in script and "\nBUDGET_S = 20.0\n" in script
    assert task.evaluator.timeout_s == 40.0
    assert next(syn.task_stream(4, check=check)).setup == syn.make_task(4, "train", 0, check=check).setup
    # the deadlines change nothing else: same prompt, same hidden tests
    plain = syn.generate_tasks(1, split="train", seed=4)[0]
    assert plain.prompt == task.prompt and plain.metadata == task.metadata
