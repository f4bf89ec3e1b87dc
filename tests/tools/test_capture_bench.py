"""``tools.bench --capture`` on the ``tiny-bn`` proxy: every row runs, and the dispatch
counts it prints are the machine-independent facts of the eager path (no ``tengrad_fx``
op with capture on; two per covered layer, forward and backward, on the custom ops), and
the launch-bound table's figures are there."""
from __future__ import annotations

import json
import math

from testing.repo_tools import tool

bench = tool("bench")
ROWS = tool("capture_bench").ROWS


def test_capture_rows_and_op_counts(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "capture.json"
    bench.main(["--capture", "--model", "tiny-bn", "--m", "4", "--steps", "2", "--warmup", "1",
                "--json", str(out)])
    full = json.loads(out.read_text())
    res = full["rows"]
    assert list(res) == list(ROWS)
    assert res["plain"]["ratio"] == 1.0 and all(r["total"] > 0 for r in res.values())
    ops = {name: r["tengrad_ops"] for name, r in res.items()}
    # tiny-bn: 3 convs + 2 Linears, 4 BatchNorms (the linconv rows leave the norms out)
    assert ops == {"plain": 0, "capture off": 0, "capture on": 0, "capture on, custom ops": 2 * 9,
                   "linconv on": 0, "linconv on, custom ops": 2 * 5}
    assert res["capture off"]["aten_ops"] == res["plain"]["aten_ops"]
    assert set(full["per_call"]) >= {"linear", "conv2d", "batchnorm2d", "embedding"}
    assert all(t > 0 for r in full["per_call"].values() for t in r.values())
    bound = full["launch_bound"]  # the deep narrow model: µs per covered call (any sign on a loaded machine)
    assert bound["covered_calls"] == 101 and bound["plain_us"]["fwd+bwd"] > bound["plain_us"]["forward"] > 0
    assert all(math.isfinite(bound[row][w]) for row in ("off", "on") for w in ("forward", "fwd+bwd"))
    out = capsys.readouterr().out
    assert "x plain" in out and "launch-bound" in out
