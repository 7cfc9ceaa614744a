import sys

from baton.cli import console

sys.exit(console())
