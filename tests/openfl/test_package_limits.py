"""Packages are bounded from the archive's central directory before any entry is read (issue 34): a
zip bomb is refused in one sentence with bounded memory and nothing written; the limits are the
site's to set; entries are scanned in a stream."""

import os
import subprocess
import sys
import zipfile

import pytest

from fedcontrast.archives import ArchiveLimits, ArchiveRefused, check_archive
from fedcontrast.errors import ConfigError
from fedcontrast.openfl.plan import build_plan
from fedcontrast.privacy.policy import SitePolicy

from .test_deploy import deployment, images
from .test_package_trust import write_package

MEMORY_BOUND_MB = 900  # the CLI's own imports (torch among them) take a few hundred MB; the bomb's entry is 2048 MB


def bomb(path, size_mib=2048):
    """A valid-looking package with one entry of ``size_mib`` MiB of zeros (about 9 MB compressed)."""
    write_package(path, build_plan(deployment()))
    zero = bytes(1 << 20)
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("save/init.pbuf", "w", force_zip64=True) as f:
            for _ in range(size_mib):
                f.write(zero)
    return path


def test_a_zip_bomb_is_refused_before_anything_is_read_with_bounded_memory(tmp_path):
    package = bomb(tmp_path / "fed.zip")
    assert package.stat().st_size < 16 << 20
    data = images(tmp_path / "data", {"neg": 3, "pos": 3})
    site = tmp_path / "site"
    peak_file = tmp_path / "peak"
    # The child's own peak (VmHWM of its address space, written as it exits): not ru_maxrss, which a child
    # started by fork keeps from its parent across exec — pytest's own size late in a full run.
    measured = ("import atexit, runpy, sys\n"
                "def peak():\n"
                "    line = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
                f"    open({str(peak_file)!r}, 'w').write(line.split()[1])\n"
                "atexit.register(peak)\n"
                "sys.argv = ['fedcontrast'] + sys.argv[1:]\n"
                "runpy.run_module('fedcontrast.cli', run_name='__main__')\n")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as errors:
        proc = subprocess.run([sys.executable, "-c", measured, "site", "join", str(package), "--name", "hosp1",
                               "--data", str(data), "--into", str(site)], stdout=out, stderr=errors, timeout=300)
    err = (tmp_path / "err").read_text()
    peak_mb = int(peak_file.read_text()) / 1024  # kB
    assert proc.returncode != 0 and "Traceback" not in err, err[-2000:]
    line = err.strip()
    assert len(line.splitlines()) == 1 and "save/init.pbuf unpacks to 2.00 GiB from" in line, line
    assert "above the 100 of package_limits.max_ratio" in line and "nothing was unpacked" in line
    assert not (site / "fed").exists()  # nothing written
    assert peak_mb < MEMORY_BOUND_MB, f"peak memory {peak_mb:.0f} MB"
    print(f"site join of a {package.stat().st_size / 1e6:.1f} MB package holding a 2 GiB entry: refused, peak RSS "
          f"{peak_mb:.0f} MB")


def test_each_limit_is_checked_and_settable_by_the_site(tmp_path):
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(5):
            z.writestr(f"f{i}.txt", b"x" * 1000)  # small entries compress far above 100x: not a bomb
        z.writestr("big.bin", os.urandom(3 << 20))
    assert len(check_archive(archive)) == 6
    with pytest.raises(ArchiveRefused, match=r"holds 6 entries, more than the 5 of package_limits.max_entries"):
        check_archive(archive, ArchiveLimits(max_entries=5))
    with pytest.raises(ArchiveRefused, match=r"entry big.bin unpacks to 3.0 MiB, more than the 2.0 MiB of "
                                             r"package_limits.max_entry_bytes"):
        check_archive(archive, ArchiveLimits(max_entry_bytes=2 << 20))
    with pytest.raises(ArchiveRefused, match=r"unpacks to more than 3.0 MiB \(package_limits.max_total_bytes\)"):
        check_archive(archive, ArchiveLimits(max_total_bytes=3 << 20))
    policy = tmp_path / "policy.yaml"
    policy.write_text("package_limits: {max_entries: 5}\n")
    assert SitePolicy.from_yaml(policy).package_limits == {"max_entries": 5}
    policy.write_text("package_limits: {max_files: 5}\n")
    with pytest.raises(ConfigError, match="policy package_limits has unknown limit"):
        SitePolicy.from_yaml(policy)
    (tmp_path / "not.zip").write_bytes(b"not a zip")
    with pytest.raises(ArchiveRefused, match="is not a readable zip archive"):
        check_archive(tmp_path / "not.zip")


def test_the_sites_own_limit_refuses_a_package_at_join(tmp_path):
    from fedcontrast.openfl.institution_flows import join

    package = write_package(tmp_path / "fed.zip", build_plan(deployment()))
    policy = tmp_path / "policy.yaml"
    policy.write_text("package_limits: {max_entries: 2}\n")
    with pytest.raises(ArchiveRefused, match=r"the package fed.zip holds \d entries, more than the 2 of "
                                             "package_limits.max_entries"):
        join(package, name="hosp1", data=images(tmp_path / "data", {"neg": 3, "pos": 3}), into=tmp_path / "site",
             policy=policy)
    assert not (tmp_path / "site" / "fed").exists()


def test_entries_are_scanned_in_a_stream_never_read_whole(tmp_path):
    """A large entry within the limits (a site that raised max_ratio) is scanned for key material chunk by
    chunk: the scan's peak memory stays far below the entry's size, and a key at its end is still found."""
    package = bomb(tmp_path / "fed.zip", size_mib=512)
    with zipfile.ZipFile(package, "a", zipfile.ZIP_DEFLATED) as z:
        with z.open("save/notes.bin", "w", force_zip64=True) as f:
            for _ in range(64):
                f.write(bytes(1 << 20))
            f.write(b"-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n")
    program = ("import resource, sys\nfrom fedcontrast.deploy.trust import archive_findings\n"
               "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
               "code, keys = archive_findings(sys.argv[1])\n"
               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, [str(k) for k in keys])")
    proc = subprocess.run([sys.executable, "-c", program, str(package)], capture_output=True, text=True, timeout=300)
    grown_kib, keys = proc.stdout.split(" ", 1)
    assert "save/notes.bin (a PEM private key)" in keys, proc.stdout + proc.stderr[-2000:]
    assert int(grown_kib) / 1024 < 64, f"the scan grew by {int(grown_kib) / 1024:.0f} MB for a 512 MiB entry"
