"""The tokenizer's corpus, its deterministic training (with filler tokens when the corpus
is too small), and the on-disk cache: built once, then reused; a corrupt or partial
entry is rebuilt, never trusted. A small recipe (a few files, a few hundred ids) in a
temporary cache keeps these fast."""

from __future__ import annotations

import json

import pytest

from fleetrl.actors.model import BpeRecipe, CorpusError, TokenizerCacheError, bpe_tokenizer, load_bpe_tokenizer
from fleetrl.actors.model.bpe_tokenizer import FILLER, bpe_tokenizer_file
from fleetrl.actors.model.stdlib_corpus import corpus_digest, corpus_files, stdlib_root
from fleetrl.actors.model.tokenizer_cache import MANIFEST, cached_build, default_cache_root, entry_problem

CODE = "def add(left, right):\n    return left + right\n\nclass Point:\n    x: int = 0\n"


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages" / "dep").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "b.py").write_text(CODE * 3)
    (root / "pkg" / "a.py").write_text("# é ✓\nprint('hello world')\n" + CODE)
    (root / "bad.py").write_bytes(b"x = '\xff\xfe'\n")  # not UTF-8
    (root / "notes.txt").write_text("not python")
    (root / "site-packages" / "dep" / "x.py").write_text("installed = True\n")
    (root / "pkg" / "__pycache__" / "c.py").write_text("cached = True\n")
    return root


@pytest.fixture
def builds(monkeypatch):
    """Counts the trainings (the real training still runs)."""
    calls = []
    real = bpe_tokenizer.train_bpe_tokenizer

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bpe_tokenizer, "train_bpe_tokenizer", counting)
    return calls


def test_corpus_files_skip_installed_packages_and_sort(corpus):
    assert [p.relative_to(corpus).as_posix() for p in corpus_files(corpus)] == ["b.py", "bad.py", "pkg/a.py"]
    (corpus / "only_installed" / "site-packages").mkdir(parents=True)
    (corpus / "only_installed" / "site-packages" / "x.py").write_text("")
    with pytest.raises(CorpusError, match="holds no \\*.py file"):
        corpus_files(corpus / "only_installed")
    with pytest.raises(CorpusError, match="is not a directory"):
        corpus_files(corpus / "missing")


def test_stdlib_corpus_is_the_interpreters_own():
    files = corpus_files()
    assert len(files) > 500
    assert not any("site-packages" in p.parts for p in files)
    assert all(p.is_relative_to(stdlib_root()) for p in files)


def test_digest_changes_with_any_file(corpus):
    before = corpus_digest(corpus_files(corpus), corpus)
    (corpus / "b.py").write_text(CODE)
    edited = corpus_digest(corpus_files(corpus), corpus)
    (corpus / "b.py").rename(corpus / "c.py")
    renamed = corpus_digest(corpus_files(corpus), corpus)
    assert len({before, edited, renamed}) == 3


def test_small_corpus_is_filled_to_the_exact_size(corpus, tmp_path):
    recipe = BpeRecipe(vocab_size=700, corpus_root=corpus)
    tok = load_bpe_tokenizer(recipe, cache_root=tmp_path / "cache")
    assert len(tok) == 700
    build = json.loads((bpe_tokenizer_file(recipe, cache_root=tmp_path / "cache").parent / MANIFEST).read_text())
    filled = build["build"]["filled"]
    assert filled > 0 and 256 + build["build"]["merges"] + filled + 5 == 700
    first_filler = 700 - 5 - filled
    assert tok.convert_ids_to_tokens(first_filler) == FILLER.format(0)
    assert tok.decode([first_filler]) == "<|unused_0|>"
    assert all(tok.backend_tokenizer.decode_batch([[i] for i in range(700)], skip_special_tokens=False))
    text = "print('hello world')  # ✓ ünïcode"
    assert tok.decode(tok.encode(text)) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 697 == tok.eos_token_id


def test_training_is_deterministic(corpus, tmp_path):
    recipe = BpeRecipe(vocab_size=400, corpus_root=corpus)
    a = bpe_tokenizer_file(recipe, cache_root=tmp_path / "one").read_bytes()
    b = bpe_tokenizer_file(recipe, cache_root=tmp_path / "two").read_bytes()
    assert a == b


def test_built_once_then_reused(corpus, tmp_path, builds):
    recipe = BpeRecipe(vocab_size=400, corpus_root=corpus)
    announced = []
    first = bpe_tokenizer_file(recipe, cache_root=tmp_path, on_build=lambda: announced.append(1))
    second = bpe_tokenizer_file(recipe, cache_root=tmp_path, on_build=lambda: announced.append(1))
    assert first == second and len(builds) == 1 and len(announced) == 1
    assert first.parent.parent == tmp_path and first.parent.name == recipe.key(corpus_files(corpus))
    (corpus / "new.py").write_text("y = 2\n")  # another corpus is another key
    assert bpe_tokenizer_file(recipe, cache_root=tmp_path).parent != first.parent and len(builds) == 2


@pytest.mark.parametrize("damage", ["truncate", "edit_manifest", "drop_manifest", "drop_tokenizer", "foreign_key"])
def test_damaged_entry_is_rebuilt(corpus, tmp_path, builds, damage):
    recipe = BpeRecipe(vocab_size=400, corpus_root=corpus)
    path = bpe_tokenizer_file(recipe, cache_root=tmp_path)
    good = path.read_bytes()
    manifest = path.parent / MANIFEST
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "edit_manifest":
        manifest.write_text(manifest.read_text()[:-20])
    elif damage == "drop_manifest":
        manifest.unlink()
    elif damage == "drop_tokenizer":
        path.unlink()
    else:
        data = json.loads(manifest.read_text())
        data["key"] = "0" * 32
        manifest.write_text(json.dumps(data))
    assert entry_problem(path.parent, path.parent.name) is not None
    again = bpe_tokenizer_file(recipe, cache_root=tmp_path)
    assert len(builds) == 2
    assert again == path and again.read_bytes() == good
    assert entry_problem(again.parent, again.parent.name) is None
    assert len(load_bpe_tokenizer(recipe, cache_root=tmp_path)) == 400 and len(builds) == 2


def test_leftover_partial_build_is_ignored(corpus, tmp_path, builds):
    recipe = BpeRecipe(vocab_size=400, corpus_root=corpus)
    key = recipe.key(corpus_files(corpus))
    partial = tmp_path / f".build-{key}-crashed"
    partial.mkdir()
    (partial / "tokenizer.json").write_text("{")  # a build that died half-way
    path = bpe_tokenizer_file(recipe, cache_root=tmp_path)
    assert path.parent == tmp_path / key and len(builds) == 1
    assert json.loads(path.read_text())["model"]["type"] == "BPE"


def test_cache_errors_name_the_place(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(TokenizerCacheError, match="cannot be written"):
        cached_build("k", lambda d: {}, root=blocked / "cache")
    with pytest.raises(TokenizerCacheError, match="wrote no file"):
        cached_build("k", lambda d: {}, root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "k").exists()
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        BpeRecipe(vocab_size=100)


def test_default_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_root() == tmp_path / "fleetrl" / "tokenizers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "fleetrl" / "tokenizers"
