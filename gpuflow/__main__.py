import sys

from gpuflow.cli import command

sys.exit(command())
