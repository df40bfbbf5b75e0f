import sys

from longspec_jax.inference.cli import main

sys.exit(main())
