"""`python -m qforensics.cli`: the same as the `qforensics` command."""

from qforensics.cli import main

main(prog_name="qforensics")
