import sys

from gpuflow.cli import main

sys.exit(main())
