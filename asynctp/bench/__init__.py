"""The benchmark harness behind `asynctp bench`: per op and shape, the bounds, serial, torch's
fused op and asynctp, checked equal, then timed (see measure.py for the order of a row).

    shapes.py   the shape sets            cases.py    the registry of benchmarked ops
    timing.py   events, medians, graphs   measure.py  one run on every rank
    report.py   rows, tables, files       plot.py     the efficiency PNG
    launch.py   spawning the ranks        cli.py      the command line
    contention.py  a matmul's slowdown beside a collective (`--contention`)

Nothing here is public API; `asynctp bench --help` is the interface.
"""
