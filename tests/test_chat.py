"""Interactive `nerva run` in a terminal, driven like a person would (pexpect in a pty)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from nerva_cli.pull import pull

pexpect = pytest.importorskip("pexpect")


def spawn(model_dir, home):
    env = dict(os.environ, NERVA_HOME=str(home))
    return pexpect.spawn(sys.executable, ["-m", "nerva_cli", "run", str(model_dir), "--temperature", "0",
                                          "-n", "6", "--no-profile", "--ctx", "256"],
                         env=env, encoding="utf-8", timeout=120)


def test_chat_turns_bye_and_ctrl_d(tiny_models, tmp_path, nerva_home):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    chat = spawn(model.path, nerva_home)
    chat.expect(">>> ")
    chat.sendline("the quick brown fox")
    chat.expect(">>> ")
    first = chat.before
    chat.sendline("jumps over the lazy dog")
    chat.expect(">>> ")  # a second turn reuses the cached conversation and answers again
    chat.sendline("/bye")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0 and "Traceback" not in first
    if importlib.util.find_spec("readline"):  # the next chat's up-arrow finds these lines
        assert "jumps over the lazy dog" in (nerva_home / "history").read_text()
    chat = spawn(model.path, nerva_home)
    chat.expect(">>> ")
    chat.sendeof()  # Ctrl-D leaves too
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_chat_commands_and_a_multi_line_message(tiny_models, tmp_path, nerva_home):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    chat = spawn(model.path, nerva_home)
    chat.expect(">>> ")
    chat.sendline("/?")
    chat.expect(">>> ")
    assert "/set parameter NAME VALUE" in chat.before and '"""' in chat.before
    chat.sendline("/set parameter top_p 7")  # refused in one line; the chat goes on
    chat.expect(">>> ")
    assert "error: /set parameter top_p" in chat.before
    chat.sendline('"""the quick')
    chat.expect(r"\.\.\. ")
    chat.sendline('brown fox"""')
    chat.expect(">>> ")
    chat.sendline("/show info")
    chat.expect(">>> ")
    assert "tokens in use" in chat.before and "Traceback" not in chat.before
    used = int(chat.before.split("context")[1].split()[0])
    assert used > 0  # the two-line message was answered
    chat.sendline("/bye")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
