"""What a Flower party's log file gets from `fedcontrast flower supernode|superlink|run`: no colour
codes, Flower's own INFO chatter only with --verbose, and a SuperNode's own line once it connected."""

import argparse
import sys

from fedcontrast.cli import flower as cli_flower

COLOURED_INFO = "\x1b[92mINFO \x1b[0m:      SuperNode ID: 7\n"
COLOURED_WARNING = "\x1b[93mWARNING \x1b[0m:   the SuperLink is slow\n"


def test_a_file_gets_no_colour_codes_and_no_flower_info():
    assert cli_flower.shown(COLOURED_INFO) is None
    assert cli_flower.shown(COLOURED_WARNING) == "WARNING :   the SuperLink is slow\n"
    assert cli_flower.shown("fedcontrast: round 1/2 done in 3.1 s\n") == "fedcontrast: round 1/2 done in 3.1 s\n"
    assert cli_flower.shown(COLOURED_INFO, verbose=True) == "INFO :      SuperNode ID: 7\n"
    assert cli_flower.shown(COLOURED_WARNING, terminal=True) == COLOURED_WARNING  # a terminal shows colours


def test_the_child_output_passed_on(capfd):
    program = ("import sys; sys.stdout.write(" + repr(COLOURED_INFO + COLOURED_WARNING + "fedcontrast: ours\n")
               + "); sys.stdout.flush()")
    lines = []
    code = cli_flower._run_child([sys.executable, "-c", program], {}, on_line=lines.append)
    out = capfd.readouterr().out
    assert code == 0
    assert "\x1b" not in out and "SuperNode ID" not in out
    assert out.splitlines() == ["WARNING :   the SuperLink is slow", "fedcontrast: ours"]
    assert lines[0] == "INFO :      SuperNode ID: 7\n"  # every line watched, colour codes removed


def test_a_supernode_says_it_connected(monkeypatch, capsys):
    def child(command, env, *, watch=None, verbose=False, on_line=None, signalled=None, **_):
        on_line(cli_flower.ANSI.sub("", COLOURED_INFO))
        signalled.append(15)  # then the site stops it (one that ends by itself is started again: test_flower_link.py)
        return 0

    monkeypatch.setattr(cli_flower, "_run_child", child)
    args = argparse.Namespace(name="hosp1", superlink="op.example:9092", retry_refused=0.0, verbose=False,
                              key="hosp1.key")
    assert cli_flower._supernode(args, ["flower-supernode"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "hosp1: connected to the SuperLink at op.example:9092; waiting for the operator's run"]
