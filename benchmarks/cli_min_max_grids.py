"""`tqsdeploy` with the clip search off on every integer grid: min-max grids only, as at 95188a9 (run on demand).

At 95188a9 `baseline` rounded onto min-max grids (its clip search was off by default); today's code restricted to
them reproduces 95188a9's uniform QEP digit for digit on lorenz96 and the tied mixer (calib_spread.md), so it stands
in for the old checkout:
`python benchmarks/bench_calib_spread.py --cli today=$(which tqsdeploy),minmax=benchmarks/cli_min_max_grids.py`,
or `python benchmarks/cli_min_max_grids.py baseline MODEL --method qep --bits 2 ...`."""

import sys
from dataclasses import replace

import tiers.column_loop
import tiers.gptq
import tiers.grid
import tiers.quantizer

_find_grid = tiers.grid.find_grid


def find_grid(rows, spec):
    return _find_grid(rows, replace(spec, search=False) if spec.kind == "int" else spec)


for module in (tiers.grid, tiers.column_loop, tiers.gptq, tiers.quantizer):
    module.find_grid = find_grid

from tqsdeploy.cli import main  # noqa: E402

sys.argv[0] = "tqsdeploy"
main()
