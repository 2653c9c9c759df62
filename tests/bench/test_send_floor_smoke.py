"""The loopback send probe runs end to end on a few sockets: every byte reaches the reader
(it waits for all of them), each cell counts its sends, and the table and JSON carry every
cell. No timing is checked."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies import send_floor


def test_the_probe_delivers_every_send_and_reports_each_cell(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cells.json"
    send_floor.main(["--connections", "3", "--rounds", "4", "--bytes", "180", "360", "--gap-ms", "0", "1",
                     "--out", str(out)])
    cells = json.loads(out.read_text())
    assert [(c["payload"], c["gap_ms"]) for c in cells] == [(180, 0.0), (360, 0.0), (180, 1.0), (360, 1.0)]
    assert all(c["sends"] == 12 and c["connections"] == 3 for c in cells)
    assert all(c["sender_wall_us_per_send"] > 0 for c in cells)
    table = capsys.readouterr().out
    assert table.count("\n| 180 |") == 2 and table.count("\n| 360 |") == 2
