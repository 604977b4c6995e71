"""`fedcontrast site start` runs every doctor check, then os.execv replaces it with `fx collaborator
start`, which imports OpenFL (and through it scikit-learn, SciPy, pandas, gRPC). The checks themselves
must not import OpenFL: each site would pay those imports twice (benchmarks/startup.py)."""

import subprocess
import sys

PROBE = """
import sys
from fedcontrast.config import RunConfig
from fedcontrast.deploy import workspace
from fedcontrast.site import checks
from fedcontrast.openfl import doctor, guard
from fedcontrast.audit import report as audit

assert workspace.shard_index("shard:1", 2) == 1
policy = checks.enforce_site_policy(RunConfig(), {"use_tls": True, "require_client_auth": True},
                                    {"in_channels": 1, "image_size": 8, "num_classes": 10}, "shard:0", cwd=sys.argv[1])
assert policy is None
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("openfl", "sklearn", "scipy", "pandas", "grpc"))
print(" ".join(loaded))
"""


def test_the_site_checks_do_not_import_openfl(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"imported by the site's checks: {done.stdout.strip()[:500]}"


def test_the_old_names_are_the_same_objects():
    from fedcontrast.openfl import collaborator, loader, protocol
    from fedcontrast.site import checks, data

    assert collaborator.CollaboratorStopped is protocol.CollaboratorStopped
    assert issubclass(loader.SiteDataLoader, data.SiteData)
    assert data.enforce_site_policy is checks.enforce_site_policy
