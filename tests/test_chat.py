"""Interactive `nerva run` in a terminal, driven like a person would (pexpect in a pty)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from nerva_cli.store.pull import pull

pexpect = pytest.importorskip("pexpect")


def spawn(model_dir, home):
    env = dict(os.environ, NERVA_HOME=str(home))
    return pexpect.spawn(sys.executable, ["-m", "nerva_cli", "run", str(model_dir), "--temperature", "0",
                                          "-n", "6", "--no-profile", "--ctx", "256"],
                         env=env, encoding="utf-8", timeout=120)


def say(chat, line: str, prompt: str = ">>> ") -> str:
    """Types a line and waits for the next prompt; -> what the chat printed in between."""
    chat.sendline(line)
    chat.expect(prompt)
    return chat.before


def leave(chat) -> int:
    chat.expect(pexpect.EOF)
    chat.close()
    return chat.exitstatus


def test_chat_turns_bye_and_ctrl_d(tiny_models, tmp_path, nerva_home):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    chat = spawn(model.path, nerva_home)
    chat.expect(">>> ")
    first = say(chat, "the quick brown fox")
    say(chat, "jumps over the lazy dog")  # a second turn reuses the cached conversation and answers again
    chat.sendline("/bye")
    assert leave(chat) == 0 and "Traceback" not in first
    if importlib.util.find_spec("readline"):  # the next chat's up-arrow finds these lines
        assert "jumps over the lazy dog" in (nerva_home / "history").read_text()
    chat = spawn(model.path, nerva_home)
    chat.expect(">>> ")
    chat.sendeof()  # Ctrl-D leaves too
    assert leave(chat) == 0


def test_chat_commands_and_a_multi_line_message(tiny_models, tmp_path, nerva_home):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    chat = spawn(model.path, nerva_home)
    chat.expect(">>> ")
    shown = say(chat, "/?")
    assert "/set parameter NAME VALUE" in shown and '"""' in shown
    assert "error: /set parameter top_p" in say(chat, "/set parameter top_p 7")  # one line; the chat goes on
    say(chat, '"""the quick', prompt=r"\.\.\. ")
    say(chat, 'brown fox"""')
    info = say(chat, "/show info")
    assert "tokens in use" in info and "Traceback" not in info
    assert int(info.split("context")[1].split()[0]) > 0  # the two-line message was answered
    assert "tok/s" not in say(chat, "jumps over")  # ollama's /set verbose: the rates after each answer
    say(chat, "/set verbose")
    assert "tok/s" in say(chat, "the lazy dog") and "stop: " in chat.before
    say(chat, "/set quiet")
    assert "tok/s" not in say(chat, "and runs")
    chat.sendline("/bye")
    assert leave(chat) == 0
