"""`python -m snapcompile.cli`: the same command as `snapcompile`."""
from snapcompile.cli import main

main()
