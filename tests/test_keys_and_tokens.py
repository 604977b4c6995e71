"""Issue 34: a SuperNode private key that its group or others may read is refused as ssh refuses it,
and a Ray token that Ray would refuse or choke on (empty file, missing file, empty variable) is one
sentence — never Ray's AuthenticationError traceback."""

import os
import subprocess
import sys

import pytest

from fedcontrast.errors import ConfigError
from fedcontrast.flower import deploy
from fedcontrast.sim.ray_executor import check_ray_token


@pytest.mark.parametrize("mode, who", [(0o644, "its group and others"), (0o640, "its group"), (0o604, "others")])
def test_a_supernode_key_readable_by_others_is_refused_like_ssh(tmp_path, mode, who):
    private, _, _ = deploy.make_site_key(tmp_path, "hosp1")
    assert private.stat().st_mode & 0o777 == 0o600
    (tmp_path / "ca.crt").write_text("ca")
    (tmp_path / "data").mkdir()
    common = dict(superlink="agg:9092", ca=tmp_path / "ca.crt", key=private, name="hosp1", data=tmp_path / "data",
                  workdir=tmp_path / "work")
    os.chmod(private, mode)
    with pytest.raises(ConfigError) as info:
        deploy.supernode_command(**common, port=0)
    assert str(info.value) == (f"this site's private key {private} has permissions {mode:04o}, which let {who} use it "
                               f"(ssh refuses such keys too): run `chmod 600 {private}`, and if others could read it, "
                               "make a new key (`fedcontrast flower site-key`) and have the operator register it")


def test_ray_token_problems_are_one_sentence(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(empty)}
    with pytest.raises(ConfigError, match=rf"RAY_AUTH_MODE=token, but the token file {empty} \(RAY_AUTH_TOKEN_PATH\) "
                                          r"is empty: copy the cluster's token there"):
        check_ray_token(env)
    with pytest.raises(ConfigError, match="does not exist"):
        check_ray_token({**env, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="RAY_AUTH_TOKEN is set and empty"):
        check_ray_token({**env, "RAY_AUTH_TOKEN": " "})
    empty.write_text("abc def\n")
    with pytest.raises(ConfigError, match="holds 2 words, not one token"):
        check_ray_token(env)
    empty.write_text("a" * 64 + "\n")
    check_ray_token(env)  # a token Ray can use
    check_ray_token({})  # no token authentication: nothing to check


def test_simulate_on_ray_with_an_empty_token_file_is_one_sentence(tmp_path):
    (tmp_path / "token").write_text("")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token")}
    proc = subprocess.run([sys.executable, "-m", "fedcontrast.cli", "simulate", "--algorithm", "fedavg", "--clients",
                           "2", "--rounds", "1", "--executor", "ray", "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300, env=env)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert len(err.splitlines()) == 1
    assert err == (f"fedcontrast: error: RAY_AUTH_MODE=token, but the token file {tmp_path / 'token'} "
                   "(RAY_AUTH_TOKEN_PATH) is empty: copy the cluster's token there (`ray get-auth-token` "
                   "on its head), or unset RAY_AUTH_MODE for a local Ray")
