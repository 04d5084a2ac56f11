"""``validate --force`` removes an earlier run's outputs from the folder it checked, through that
folder's descriptor: swapping the folder's path for a link to another of root's folders after the
check removes nothing there.

The attacker is a throwaway local user (``support.hostile``) who may rename entries of the folder
holding ``--out`` (a share writable by others); run as root, skipped with the reason elsewhere.
"""

from __future__ import annotations

from support import validate_attack
from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.subproc import call


def test_force_never_removes_outside_the_folder_it_checked(tmp_path, hostile_user):
    fake = tmp_path / "fake"
    fake.mkdir()
    validate_attack.setup(fake)
    runs = hostile_user.shared / "runs"  # mode 0777, not sticky: the attacker may rename what is in it
    runs.mkdir()
    runs.chmod(0o777)
    out = runs / "out"  # root's earlier run, private
    (out / "reports").mkdir(parents=True)
    out.chmod(0o700)
    (out / "reports" / "h-1.json").write_text("{}")
    (out / "report.json").write_text('{"an earlier run": true}')
    victim = tmp_path / "victim"  # root's own folder elsewhere, holding names validate clears
    (victim / "reports").mkdir(parents=True)
    for name in ("report.json", "server.log", "deploy.yaml", "reports/keep.json"):
        (victim / name).write_text(f"root's {name}")
    attack = {"when": "preflight", "uid": hostile_user.uid, "gid": hostile_user.gid,
              "script": f'mv "{out}" "{runs}/out.old" && ln -s "{victim}" "{out}"'}
    done = call(validate_attack.run_validate, str(fake), validate_attack.argv(fake, out, "--force"), attack,
                False, False, env={"FAKE_DIR": str(fake)}, timeout=300, with_output=True)
    assert "attacked at preflight" in done["result"]["reached"], done["output"]
    kept = {str(p.relative_to(victim)): p.read_bytes() for p in victim.rglob("*") if p.is_file()}
    assert kept == {name: f"root's {name}".encode() for name in ("report.json", "server.log", "deploy.yaml",
                                                      "reports/keep.json")}, done["output"]
    # --force did its work, in the folder it checked: the earlier run's report folder is gone
    assert not (runs / "out.old" / "reports" / "h-1.json").exists(), done["output"]
    assert done["result"]["exit"] == 2 and "no longer names the folder" in done["stderr"], done["stderr"]
