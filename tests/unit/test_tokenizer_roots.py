"""A job's `tokenizer` is confined to the operator's --tokenizer-roots (and the model path a worker's
server reports): the API judges the text alone, a writer the folder with its symbolic links followed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hsx.cli import main
from hsx.config import Settings, tokenizer_refusal, tokenizer_within_roots

ROOTS = ["/models", "/srv/tok"]


@pytest.mark.parametrize("path", ["/models/llama", "/models", "/srv/tok/a/b/", "/models/./x/../y", "org/served"])
def test_paths_under_a_root_and_the_reported_model_path_are_allowed(path):
    assert tokenizer_refusal(path, ROOTS, {"org/served"}) is None


@pytest.mark.parametrize(
    "path", ["/etc", "/proc/self/cwd", "../../etc", "models/llama", "/models/../etc", "/modelsx", "//models/x", ""]
)
def test_anything_else_is_refused_naming_the_roots(path):
    why = tokenizer_refusal(path, ROOTS, {"org/served"})
    assert why is not None and "--tokenizer-roots: /models, /srv/tok" in why


def test_with_no_roots_only_the_model_path_is_allowed():
    assert tokenizer_refusal("/models/llama", [], {"/models/served"}) is not None
    assert tokenizer_refusal("/models/served", [], {"/models/served"}) is None


def test_a_writer_follows_symbolic_links_out_of_the_roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (tmp_path / "root-link").symlink_to(root)
    assert tokenizer_within_roots(str(root / "real"), [str(root)])
    assert tokenizer_within_roots(str(root / "not-yet"), [str(root)])
    assert not tokenizer_within_roots(str(root / "escape"), [str(root)]), "a link under the root leads out"
    assert tokenizer_within_roots(str(root / "real"), [str(tmp_path / "root-link")]), "a root named through a link"
    assert tokenizer_refusal(str(root / "escape"), [str(root)], set()) is None, "the API sees the text only"


def test_roots_are_absolute_folders_listed_with_commas(monkeypatch):
    monkeypatch.setenv("HSX_TOKENIZER_ROOTS", "/models/, /srv/tok/a/..")
    assert Settings().tokenizer_root_list() == ["/models", "/srv/tok"]
    with pytest.raises(ValidationError, match="not an absolute path"):
        Settings(tokenizer_roots="/models,relative")


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_both_commands_take_the_flag(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tokenizer-roots" in out and "HSX_TOKENIZER_ROOTS" in out
