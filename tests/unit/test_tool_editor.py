"""The editor toolset: view/create/str_replace/insert in the workspace, and no path that leaves it."""

import asyncio
import os

import pytest

from services.envs.tools import TOOLSETS, ToolContext, ToolError


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    return tmp_path / "ws"


def edit(workspace, **arguments) -> str:
    cls = TOOLSETS.get("editor")
    toolset = cls(cls.Options(max_file_bytes=1000, max_view_chars=200))
    return asyncio.run(toolset.call("editor", arguments, ToolContext("episode", workspace, 10.0))).content


def error(workspace, **arguments) -> ToolError:
    with pytest.raises(ToolError) as raised:
        edit(workspace, **arguments)
    return raised.value


def test_create_view_and_view_range(workspace):
    edit(workspace, command="create", path="src/a.py", file_text="one\ntwo\nthree\n")
    assert (workspace / "src" / "a.py").read_text() == "one\ntwo\nthree\n"
    assert edit(workspace, command="view", path="src/a.py") == "     1\tone\n     2\ttwo\n     3\tthree"
    assert edit(workspace, command="view", path="src/a.py", view_range=[2, -1]) == "     2\ttwo\n     3\tthree"
    assert edit(workspace, command="view", path="src/a.py", view_range=[2, 2]) == "     2\ttwo"
    assert error(workspace, command="view", path="src/a.py", view_range=[4, 5]).kind == "failed"
    assert error(workspace, command="view", path="src/a.py", view_range=[3, 2]).kind == "failed"
    assert "already exists" in str(error(workspace, command="create", path="src/a.py", file_text="x"))
    assert edit(workspace, command="view", path=".") == ".:\nsrc/\nsrc/a.py"


def test_str_replace_needs_exactly_one_match(workspace):
    (workspace / "f.txt").write_text("a = 1\nb = 1\nc = 2\n")
    assert "occurs 0 times" in str(error(workspace, command="str_replace", path="f.txt", old_str="d = 1"))
    assert "occurs 2 times" in str(error(workspace, command="str_replace", path="f.txt", old_str="= 1"))
    assert (workspace / "f.txt").read_text() == "a = 1\nb = 1\nc = 2\n"
    out = edit(workspace, command="str_replace", path="f.txt", old_str="b = 1", new_str="b = 10\nb2 = 3")
    assert (workspace / "f.txt").read_text() == "a = 1\nb = 10\nb2 = 3\nc = 2\n"
    assert "     2\tb = 10" in out
    edit(workspace, command="str_replace", path="f.txt", old_str="b2 = 3\n")
    assert (workspace / "f.txt").read_text() == "a = 1\nb = 10\nc = 2\n"
    assert error(workspace, command="str_replace", path="missing.txt", old_str="x").kind == "failed"


def test_insert_after_a_line(workspace):
    (workspace / "f.txt").write_text("one\ntwo")
    edit(workspace, command="insert", path="f.txt", insert_line=0, new_str="zero")
    edit(workspace, command="insert", path="f.txt", insert_line=3, new_str="three\nfour\n")
    assert (workspace / "f.txt").read_text() == "zero\none\ntwo\nthree\nfour"
    assert "past the end" in str(error(workspace, command="insert", path="f.txt", insert_line=6, new_str="x"))
    assert "needs new_str" in str(error(workspace, command="insert", path="f.txt", insert_line=1))


def test_size_limits(workspace):
    assert error(workspace, command="create", path="big.txt", file_text="x" * 1001).kind == "limit"
    assert not (workspace / "big.txt").exists()
    edit(workspace, command="create", path="f.txt", file_text="x" * 990 + "\n")
    assert error(workspace, command="insert", path="f.txt", insert_line=1, new_str="y" * 20).kind == "limit"
    assert (workspace / "f.txt").read_text() == "x" * 990 + "\n"
    (workspace / "big.txt").write_text("x" * 2000)
    assert error(workspace, command="view", path="big.txt").kind == "limit"
    (workspace / "long.txt").write_text("line\n" * 100)
    assert "output cut at 200 characters" in edit(workspace, command="view", path="long.txt")


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "link/x", "link", "dirlink/secret.txt", "pw"])
def test_paths_that_leave_the_workspace_are_refused(workspace, path):
    outside = workspace.parent / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (workspace / "a").mkdir()
    os.symlink("/tmp", workspace / "link")
    os.symlink(outside, workspace / "dirlink")
    os.symlink("/etc/passwd", workspace / "pw")
    for arguments in ({"command": "view"}, {"command": "create", "file_text": "x"}):
        assert error(workspace, path=path, **arguments).kind == "refused"
    assert error(workspace, command="str_replace", path=path, old_str="secret", new_str="s").kind == "refused"
    assert (outside / "secret.txt").read_text() == "secret"
    assert not (outside / "x").exists() and not (workspace.parent / "x").exists()


def test_symlinks_inside_the_workspace_are_followed(workspace):
    (workspace / "real").mkdir()
    (workspace / "real" / "f.txt").write_text("hello\n")
    os.symlink(workspace / "real", workspace / "alias")
    assert edit(workspace, command="view", path="alias/f.txt") == "     1\thello"
    edit(workspace, command="str_replace", path="alias/f.txt", old_str="hello", new_str="bye")
    assert (workspace / "real" / "f.txt").read_text() == "bye\n"
