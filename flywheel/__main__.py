"""``python -m flywheel`` = the ``flywheel`` command."""

from flywheel.cli import main

main()
