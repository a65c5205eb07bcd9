"""scripts/ablate.py in its smoke mode: two variants train a few steps, the results file and the
loss-curve figure are written, and the summary table has one row per variant."""

from __future__ import annotations

import json

import numpy as np


def test_ablate_smoke(tmp_path, capsys):
    from scripts import ablate

    assert ablate.main(["--smoke", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    res = json.loads((tmp_path / "ablations.json").read_text())["results"]
    assert [r["name"] for r in res] == [ablate.VARIANTS[0][0], ablate.VARIANTS[1][0]]
    assert res[1]["settings"]["norm_position"] == "post"
    for r in res:
        assert r["steps_done"] == 3 and len(r["train"]) == 3 and not r["diverged"]
        assert np.isfinite(r["final_val"]) and r["val"][0][0] == 0
    assert table.count("\n| ") >= 3 and "post-norm" in table
    assert (tmp_path / "ablations.png").read_bytes()[:4] == b"\x89PNG"
    # the convergence-speed measure: first step whose running mean reaches the target
    curve = [[i + 1, 5.0 - 0.01 * i] for i in range(100)]
    assert ablate.steps_to(curve, 4.5, smooth=10) == 56.0  # window 47..56 has mean 4.495
    assert np.isnan(ablate.steps_to(curve, 1.0, smooth=10))
