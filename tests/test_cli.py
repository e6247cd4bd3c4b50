"""`jaxstep demo`: the main job meets its planted fault, names it, and recovers."""

import jax

from jaxstep import cli


def test_demo_names_the_fault_and_resumes(capsys):
    code = cli.main(
        ["demo", "--steps", "12", "--fault-step", "7", "--fault-position", "3", "--per-device", "4"]
    )
    out = capsys.readouterr().out
    device = jax.devices()[3].id
    assert code == 0
    assert f"training worker on device {device} failed: non-finite input in ['image']" in out
    assert "at step 7" in out
    assert f"offending examples (global batch index): [{3 * 4 + 1}]" in out
    assert "finished 12 steps" in out
