"""Every file a site reads is decoded, and one it cannot decode is one sentence naming it (issue 34):
an undecodable plan/data.yaml in doctor, in fx collaborator start's guard, requirements.txt, the
revocation record — never a UnicodeDecodeError traceback."""

import pytest

from fedcontrast.cli import main
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.enrolment import revocations
from fedcontrast.openfl.guard import guard_collaborator_start
from fedcontrast.openfl.plan import create_workspace

from .conftest import small_config

LATIN1 = "site_0,/data/m\xe9dical\n".encode("latin-1")  # saved by an editor in Latin-1


def test_an_undecodable_data_file_is_one_sentence_in_doctor_and_at_start(tmp_path, capsys):
    ws = create_workspace(tmp_path / "fed", small_config())
    (ws / "plan" / "data.yaml").write_bytes(LATIN1)
    code = main(["doctor", str(ws), "--name", "site_0"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "UnicodeDecodeError" not in out + err
    assert code != 0
    assert (f"the data file {ws / 'plan' / 'data.yaml'} is not UTF-8 text (byte 0xe9 on line 1): it is damaged or was "
            "saved in another encoding; write it again as UTF-8 text") in out + err
    with pytest.raises(ConfigError, match="is not UTF-8 text"):  # what the start-up guard says (exit 1) before fx
        guard_collaborator_start(["fx", "collaborator", "start", "-n", "site_0"], ws)


def test_requirements_and_the_revocation_record_are_decoded_or_named(tmp_path, capsys):
    ws = create_workspace(tmp_path / "fed", small_config())
    (ws / "requirements.txt").write_bytes(b"fedcontrast==0.1.0\n\xff\xfe")
    code = main(["doctor", str(ws), "--name", "site_0"])
    out, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in out + err
    assert f"requirements file {ws / 'requirements.txt'} is not UTF-8 text (byte 0xff on line 2)" in out + err
    (tmp_path / "cert").mkdir()
    (tmp_path / "cert" / "revoked.jsonl").write_bytes(b'{"sha256": "ab"}\n\x80')
    with pytest.raises(ConfigError, match=r"the revocation record .*revoked.jsonl is not UTF-8 text \(byte 0x80 on "
                                          r"line 2\)"):
        revocations(tmp_path / "cert")
