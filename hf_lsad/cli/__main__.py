"""``python -m hf_lsad.cli`` and ``accelerate launch -m hf_lsad.cli``: the ``hf-lsad`` command."""

import sys

from .main import entry

entry(sys.argv[1:])
